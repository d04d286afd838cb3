"""CLI subcommands, one module each (discovered by muser.cli)."""
