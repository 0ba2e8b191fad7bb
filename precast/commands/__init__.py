"""One module per CLI subcommand: ``add_parser(subparsers)`` registers it, ``run(args) -> int`` runs it."""
