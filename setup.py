"""Install jaxsession: the repository's top-level folders become one import namespace.

The folders keep generic names (``kernels``, ``runtime``); ``package_dir`` maps them
under ``jaxsession`` so that nothing generic lands at the top of site-packages.
"""
from setuptools import setup

PACKAGES = {
    "jaxsession": "session",
    "jaxsession.graph": "session/graph",  # the IR, import, lowering, op table, liveness
    "jaxsession.cli": "session/cli",      # the command line and its demo models
    "jaxsession.optimizer_passes": "optimizer_passes",
    "jaxsession.kernels": "kernels",
    "jaxsession.runtime": "runtime",
    # The demo (`jaxsession demo`) trains a bundled example, so examples ship too.
    "jaxsession.examples": "examples",
}

setup(
    name="jaxsession",
    version="0.1.0",
    description="A graph-mode session for JAX programs (MindSpore GPUSession style).",
    python_requires=">=3.10",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    # Tested with jax/jaxlib 0.10.x; the importer reads jaxpr primitive params,
    # which are internal and change between minor releases.
    install_requires=[
        "jax>=0.10.0,<0.11",
        "jaxlib>=0.10.0,<0.11",
        "numpy>=1.26",
        "absl-py>=1.0",
    ],
    # flax, optax and equinox only in tests: the fusion tests check the forms flax and
    # optax write, and an equinox model trains as state (tests/static_leaves_test.py).
    # pytest-xdist: the suite runs on 2 worker processes (pytest.ini).
    # hypothesis, cloudpickle and portpicker: JAX's own test modules need them
    # (tests/jax_suite_test.py runs some of them routed through the session).
    # pyflakes: tests/lint_test.py finds names used but never defined (a call
    # of an undefined function raised a raw NameError at compile).
    # orbax-checkpoint: Session.save/restore write through it (the JAX field's
    # checkpoint library: atomic steps, keep-N, sharded arrays); imported only
    # when a checkpoint is saved or restored.
    extras_require={"checkpoint": ["orbax-checkpoint"],
                    "test": ["pytest>=7", "pytest-xdist", "flax", "optax", "hypothesis",
                             "cloudpickle", "portpicker", "orbax-checkpoint", "equinox",
                             "pyflakes"]},
    entry_points={"console_scripts": ["jaxsession=jaxsession.cli:run_main"]},
)
