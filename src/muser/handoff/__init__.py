"""Disaggregated prefill, Handoff V2 (book 10.7, 14.6, 15.7; docs/handoff.md): a prefill node
streams sealed KV tiles over mutual TLS 1.3 to a decode node, which installs them detached and
swaps them in atomically, or prefills locally and says why.

    muser.handoff.certs     private CA, leaves, allow list, TLS contexts
    muser.handoff.transport frames and timeouts
    muser.handoff.manifest  sealed documents and the tile plan
    muser.handoff.ledger    replay ledger
    muser.handoff.tiles     tile payload bytes
    muser.handoff.producer  PrefillNode
    muser.handoff.receiver  RemotePrefill
"""

from .certs import Certs
from .ledger import ReplayLedger
from .producer import PrefillNode
from .receiver import Outcome, RemotePrefill

__all__ = ["Certs", "Outcome", "PrefillNode", "RemotePrefill", "ReplayLedger"]
