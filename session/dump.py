"""The save_graphs instrument: IR dumps named after the stage and pass that
produced them. It watches the pipeline from outside; passes know nothing of it.

Each compiled graph gets its own folder, `<graph id>_<name>`: the session's
graph id (4 digits, unique in the session) and the graph's name with every
character but letters, digits, `_`, `.` and `-` replaced by `_` and cut to
`NAME_CHARS` characters. A folder of that name already there (another
session's) gets `-2`, `-3`, ... appended, so two graphs never share one. A
debug option never fails a compile: a folder or file that cannot be written
is logged (absl logging) and the compile goes on.
"""
import os
import re

from absl import logging

NAME_CHARS = 64


def folder_name(graph_id, graph_name):
  """`<graph id>_<name>`, the name sanitized and shortened."""
  safe = re.sub(r"[^A-Za-z0-9_.-]", "_", graph_name)[:NAME_CHARS]
  return f"{graph_id:04d}_{safe}"


class GraphDumper:
  """Writes one graph's dumps into its own folder under `folder`."""

  def __init__(self, folder, graph_id, graph_name):
    self.count = 0
    self.folder = None  # None: nothing is written (the folder could not be made)
    base = os.path.join(folder, folder_name(graph_id, graph_name))
    for k in range(1, 100):
      path = base if k == 1 else f"{base}-{k}"
      try:
        os.makedirs(path)
      except FileExistsError:
        continue
      except OSError as exc:
        logging.warning("save_graphs: cannot make the dump folder %r (%s); graph %d "
                        "is compiled without dumps", path, exc, graph_id)
        return
      self.folder = path
      return
    logging.warning("save_graphs: %r and 98 numbered variants exist; graph %d is compiled "
                    "without dumps", base, graph_id)

  def write(self, label, text):
    """Writes `NNN_<label>.ir`; returns its path, or None where it failed (logged)."""
    if self.folder is None:
      return None
    path = os.path.join(self.folder, f"{self.count:03d}_{label}.ir")
    self.count += 1
    try:
      with open(path, "w") as f:
        f.write(text)
    except OSError as exc:
      logging.warning("save_graphs: cannot write %r (%s); the compile goes on", path, exc)
      return None
    return path

  def write_graph(self, label, graph):
    return self.write(label, graph.dump())

  def __call__(self, stage, pass_name, graph, record):
    """Pass-manager instrument: a dump after every pass that changed the graph."""
    if record.changed:
      self.write_graph(f"{stage}_{pass_name}", graph)

  def write_execution_order(self, graph):
    lines = [f"execution order of graph {graph.name}"]
    for part in graph.partitions or ():
      lines.append(part.describe())
      lines.extend(f"  {i:4d} node {n.id} {n.op} kernel={n.kernel.name} stream={n.stream}"
                   for i, n in enumerate(part.nodes))
    return self.write("execution_order", "\n".join(lines) + "\n")
