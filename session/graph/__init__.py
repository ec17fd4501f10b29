"""The graph layer: the IR (`KernelGraph`, ir.py), jaxpr import (importer.py),
lowering of nodes back to JAX (lowering.py), the op table (op_properties.py)
and the one liveness analysis (liveness.py). It knows nothing of `Session`,
the runtime or the CLI; the passes, the runtime and the Session build on it."""
