"""SessionOptions: the knobs of a Session."""
import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass
class SessionOptions:
  """Options for every graph a Session compiles.

  save_graphs: a folder; each compile writes its graph before the pipeline,
    after every pass that changed it (`NNN_<stage>_<pass>.ir`) and the final
    execution order, into a subfolder named after the graph.
  verify_graphs: run `KernelGraph.verify()` after every pass that changed the graph.
  platform: the platform kernels are selected for (default: jax's default backend).
  donate_state: let executables update state buffers in place.
  host_callbacks: run `pure_callback`s between executables rather than as
    callbacks from inside them.
  partition_or_error: raise PartitionError instead of splitting a graph into
    more than one device partition.
  disabled_passes: names of optional passes (see `pipeline.optional_pass_names()`)
    to skip.
  fold_limit_bytes: constant folding does not materialise larger results.
  """
  save_graphs: Optional[str] = None
  verify_graphs: bool = True
  platform: Optional[str] = None
  donate_state: bool = True
  host_callbacks: bool = True
  partition_or_error: bool = False
  disabled_passes: Sequence[str] = ()
  fold_limit_bytes: int = 1 << 16
