"""The save_graphs instrument: IR dumps named after the stage and pass that
produced them. It watches the pipeline from outside; passes know nothing of it."""
import os
import re


class GraphDumper:
  def __init__(self, folder, graph_name):
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", graph_name)
    self.folder = os.path.join(folder, safe)
    os.makedirs(self.folder, exist_ok=True)
    self.count = 0

  def write(self, label, text):
    path = os.path.join(self.folder, f"{self.count:03d}_{label}.ir")
    with open(path, "w") as f:
      f.write(text)
    self.count += 1
    return path

  def __call__(self, stage, pass_name, graph, record):
    """Pass-manager instrument: a dump after every pass that changed the graph."""
    if record.changed:
      self.write(f"{stage}_{pass_name}", graph.dump())

  def write_execution_order(self, graph):
    lines = [f"execution order of graph {graph.name}"]
    for part in graph.partitions or ():
      lines.append(part.describe())
      lines.extend(f"  {i:4d} node {n.id} {n.op} kernel={n.kernel.name} stream={n.stream}"
                   for i, n in enumerate(part.nodes))
    return self.write("execution_order", "\n".join(lines) + "\n")
