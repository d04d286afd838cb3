"""`muser bench <kind>`: one module per kind, each exposing register(subparsers)."""
