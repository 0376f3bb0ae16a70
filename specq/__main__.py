"""`python -m specq`: the `specq` command, for child processes that must not import from the folder they run in."""

from specq.cli.main import main

main()
