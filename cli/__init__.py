"""The `kvtier` command and the demos it runs: `main` dispatches one module per subcommand (`kvtier.cli.main`)."""

from kvtier.cli.main import main

__all__ = ["main"]
