"""`muser kvpack ls|verify|gc DIR`: inspect and maintain a kvpack directory (muser.kvpack).

    muser kvpack ls DIR [--json]         entries: kind, chunk, tokens, bytes, lane, KV type, last use
    muser kvpack verify DIR [--json]     verify every entry (digests, manifest, tile); exit 1 if any fails
    muser kvpack gc DIR [--budget BYTES] remove failing entries and dead writers' temp files, then
                                         evict least recently used entries down to the budget

Verification needs no model: each entry's manifest records its binding and layout. A store
shared by running processes stays consistent under gc (atomic names; eviction under the lock).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kvpack", help="list, verify and garbage-collect a kvpack directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ksub = p.add_subparsers(dest="kvpack_cmd", required=True, metavar="CMD")
    for name, help_ in (("ls", "list entries"), ("verify", "verify every entry"),
                        ("gc", "remove bad entries and stale temp files, evict to a budget")):
        q = ksub.add_parser(name, help=help_)
        q.add_argument("dir", help="kvpack directory")
        q.add_argument("--json", action="store_true", help="one JSON object per entry")
        if name == "gc":
            q.add_argument("--budget", type=int, help="keep at most this many bytes (LRU eviction)")
        q.set_defaults(func=run)


def _row(a) -> dict:
    m = a.manifest or {}
    b = m.get("binding") or {}
    return {"name": a.name, "ok": a.ok, "reason": a.reason, "bytes": a.size, "kind": m.get("kind"),
            "chunk": m.get("chunk"), "n_tokens": m.get("n_tokens"), "lane": b.get("lane"), "kv": b.get("kv"),
            "artifact_sha256": b.get("artifact_sha256"),
            "last_used_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.last_used))}


def run(args: argparse.Namespace) -> int:
    from ..errors import KvStateError
    from ..kvpack.store import DirectoryBackend, audit

    backend = DirectoryBackend(args.dir, create=False)
    out = sys.stdout
    if args.kvpack_cmd == "gc":
        if args.budget is not None and args.budget < 0:
            raise KvStateError(f"--budget must be >= 0 bytes, got {args.budget}")
        bad = [a for a in audit(backend) if not a.ok]
        for a in bad:
            backend.delete(a.name)
        temps = backend.stale_temps()
        for t in temps:
            t.unlink(missing_ok=True)
        evicted = backend.evict(args.budget) if args.budget is not None else []
        summary = {"removed_bad": [a.name for a in bad], "removed_temps": [t.name for t in temps],
                   "evicted": evicted, "bytes": sum(o.size for o in backend.list())}
        out.write((json.dumps(summary) if args.json else
                   f"removed {len(bad)} bad entries, {len(temps)} stale temp files; evicted {len(evicted)}; "
                   f"{summary['bytes']} bytes remain") + "\n")
        return 0
    rows = [_row(a) for a in audit(backend)]
    for r in rows:
        if args.json:
            out.write(json.dumps(r) + "\n")
        elif args.kvpack_cmd == "ls":
            out.write(f"{r['name'][:16]}… {r['kind'] or '?':4} chunk {r['chunk']!s:>4} to {r['n_tokens']!s:>7} "
                      f"{r['bytes']:>10} B  {r['lane']} kv={r['kv']} used {r['last_used_utc']}"
                      f"{'' if r['ok'] else '  BAD'}\n")
        else:
            out.write(f"{'ok ' if r['ok'] else 'BAD'} {r['name']}{'' if r['ok'] else '  ' + r['reason']}\n")
    total = sum(r["bytes"] for r in rows)
    n_bad = sum(not r["ok"] for r in rows)
    if not args.json:
        out.write(f"{len(rows)} entries, {total} bytes, {n_bad} failing verification\n")
    return 1 if (args.kvpack_cmd == "verify" and n_bad) else 0
