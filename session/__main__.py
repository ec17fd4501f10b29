"""`python -m jaxsession demo` is `jaxsession demo`."""
from jaxsession.cli import run_main

run_main()
