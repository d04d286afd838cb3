"""`muser certs init DIR` / `muser certs issue DIR NAME`: the private CA of the handoff link."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="private CA and peer certificates for the handoff link (mutual TLS)",
                       description=__doc__)
    csub = p.add_subparsers(dest="certs_cmd", required=True, metavar="ACTION")
    i = csub.add_parser("init", help="create a CA, the manifest sealing key and an empty allow list in DIR")
    i.add_argument("dir", metavar="DIR")
    i.set_defaults(func=run_init)
    s = csub.add_parser("issue", help="issue NAME.crt/NAME.key from DIR's CA and allow NAME by fingerprint")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("name", metavar="NAME", help="peer name (lowercase letters, digits, '.', '-')")
    s.set_defaults(func=run_issue)


def run_init(args: argparse.Namespace) -> int:
    from ..handoff import certs

    d = certs.init(args.dir)
    print(f"CA, hmac.key and peers.json written to {d}")
    return 0


def run_issue(args: argparse.Namespace) -> int:
    from ..handoff import certs

    crt = certs.issue(args.dir, args.name)
    print(f"{crt} issued; sha256 {certs.load_peers(crt.parent)[args.name]}")
    return 0
