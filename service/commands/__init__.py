"""The heavier `kvstitch` subcommands, one module each, imported only when their command runs."""
