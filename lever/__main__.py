"""python -m lever: the `lever` command."""

from lever.cli.main import entry

entry()
