"""What a router refuses as Ray's GCS comes and goes: the state `cluster.lifeline` last reported, and
the refusals that follow from it (docs/operations.md, "When Ray fails").

    ok        nothing
    degraded  what needs Ray (scaling), at once, with the reason; requests are served as ever
    draining  new requests too; those in flight run on
    lost      every call
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.lifeline import DRAINING, LOST, OK


@dataclass(frozen=True)
class RayGate:
    state: str = OK
    reason: str = ""  # why, in Tandem's words; "" while ok

    @property
    def lost(self) -> bool:
        return self.state == LOST

    def refuses_calls(self) -> str | None:
        """Why any call is refused (only once lost), or None."""
        return f"{self.reason}; this router serves nothing more" if self.lost else None

    def refuses_requests(self) -> str | None:
        """Why a new request is refused, or None."""
        return self.refuses_calls() or (self.reason if self.state == DRAINING else None)

    def refuses_scaling(self) -> str | None:
        """Why a call that needs Ray's GCS is refused, or None."""
        if self.state == OK:
            return None
        return self.refuses_calls() or f"{self.reason}; scaling needs Ray, and waits for it"

    def status(self) -> str:
        """`ClusterStatus.ray`: empty while ok."""
        return "" if self.state == OK else f"{self.state}: {self.reason}"
