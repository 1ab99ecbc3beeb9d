"""Which host a unit failure counts against, with both sides' reports of a session read together.

A pure module, no AWS in here. A cut network link between two live hosts looks the same
from both ends: the leader reports the follower silent (`heartbeat_loss`), the follower
reports the leader unreachable (`leader_unreachable`). Counting the first report against
the host it names blamed a healthy follower whenever the leader alone was cut off. So an
accusation of silence (failures.ACCUSING_CAUSES) is kept as a *mark* on the accused host
(time, session, accuser), and every run decides again, from every mark in the cell:

Evidence seen, one session at a time -> counted against (docs/placement.md has the table):

- the member's own failure (its engine exited, its launcher restarted, it left with an
  exit status, it is behind in the step records, the canary named it) -> that member, at once;
- A accuses B, nobody accuses A in that session, settled (failures.SETTLE_SECONDS after
  the session ended: B's own report had time to arrive) -> B (it wrote nothing: gone or frozen);
- A accuses B and B accuses A (a cut link; a leader-only partition of a two-node unit)
  -> neither: a suspect mark on each, the other one as its partner;
- C accuses A and A accuses B (a leader cut off from all: it blames one follower, its rank 1
  follower blames it) -> A once settled; a suspect mark on B;
- A accuses B, not settled yet -> a suspect mark on B;
- A accuses B, and A's instance is no longer in the cluster (replaced, quarantined and
  terminated) -> a suspect mark on B: whether anyone accused A in that session was kept
  on A's instance and is gone with it. Counting it firm quarantined the healthy follower
  that a cut-off leader kept blaming, once that leader had been quarantined and replaced;
- a host's marks (firm or suspect) name two or more different accusers in the window
  -> its suspect marks count too.

A host is quarantined when its counted failures reach `failures` within one window. A
healthy host in a leader-only partition is only ever accused by the leader cut off (one
partner), which its rank 1 follower accuses in the same session, so it never counts; a
host that fails with different partners collects suspect marks from each of them and
counts. What stays open: a pair that only ever meets each other (a two-node unit whose
hosts never change) and keeps losing its link: neither host is singled out; the unit's
restart backoff and the `unit-restarts` alarm are what an operator sees.

The marks are kept on the accused instance, in the ECS attribute `unit-accused`, as
fixed-width records of 12 characters, newest first and packed (at most 10 in the 128
characters an attribute value holds): the session end time in base 36 (6 characters), a
3-character tag of the unit and session, and a 3-character tag of the accuser's EC2
instance id. Tags are hashes: two sessions or two partners may share one (about 1 in
46,656 per pair); a shared partner tag only makes a host look less suspect.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from placement_controller.failures import ATTRIBUTE_VALUE_LIMIT, SETTLE_SECONDS

ACCUSED_ATTRIBUTE = "unit-accused"
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
TIME_CHARS = 6
TAG_CHARS = 3
MARK_CHARS = TIME_CHARS + 2 * TAG_CHARS
MAX_MARKS = ATTRIBUTE_VALUE_LIMIT // MARK_CHARS


def _base36(number: int, width: int) -> str:
    text = ""
    for _ in range(width):
        number, digit = divmod(number, 36)
        text = _DIGITS[digit] + text
    return text


def tag(text: str) -> str:
    """A short stable tag of a session or an instance id (3 base-36 characters)."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return _base36(digest % 36**TAG_CHARS, TAG_CHARS)


def session_tag(unit: str, session_id: str) -> str:
    return tag(f"{unit}/{session_id}")


@dataclass(frozen=True, order=True)
class Mark:
    """One accusation of silence against the instance that holds it."""

    at: int
    session: str
    accuser: str

    def encode(self) -> str:
        return _base36(self.at, TIME_CHARS) + self.session + self.accuser


def format_marks(marks: Iterable[Mark]) -> str:
    """Newest first, as many as fit an attribute value; no separator (fixed width)."""
    return "".join(m.encode() for m in sorted(set(marks), reverse=True)[:MAX_MARKS])


def parse_marks(value: str | None) -> set[Mark]:
    """Marks from the attribute value; a malformed record is ignored."""
    found: set[Mark] = set()
    text = (value or "").strip()
    for start in range(0, len(text) - MARK_CHARS + 1, MARK_CHARS):
        record = text[start : start + MARK_CHARS].lower()
        if all(c in _DIGITS for c in record):
            at = int(record[:TIME_CHARS], 36)
            found.add(Mark(at, record[TIME_CHARS : TIME_CHARS + TAG_CHARS], record[TIME_CHARS + TAG_CHARS :]))
    return found


@dataclass
class Tally:
    """What counts against one instance: firm failure times, suspect ones, and the suspects' partners."""

    firm: list[int] = field(default_factory=list)
    suspect: list[int] = field(default_factory=list)
    partners: set[str] = field(default_factory=set)

    @property
    def counted(self) -> list[int]:
        """Firm failures, plus the suspect ones when they involve two or more different partners."""
        return sorted(self.firm + (self.suspect if len(self.partners) >= 2 else []))


def tally(
    own: Mapping[str, Iterable[int]], marks: Mapping[str, Iterable[Mark]], now: float
) -> dict[str, Tally]:
    """Per EC2 instance id: its own failures (firm) and its marks judged with every report of their session.

    `own` and `marks` name every instance of the cluster (with no failures or marks, empty):
    an accuser among none of them has left, and with it what was said against it."""
    accused_in: dict[str, set[str]] = {}
    for instance_id, held in marks.items():
        for mark in held:
            accused_in.setdefault(mark.session, set()).add(tag(instance_id))
    present = {tag(instance_id) for instance_id in set(own) | set(marks)}
    result: dict[str, Tally] = {}
    for instance_id in sorted(set(own) | set(marks)):
        counts = Tally(firm=sorted(set(own.get(instance_id, ()))))
        for mark in sorted(set(marks.get(instance_id, ()))):
            settled = now - mark.at >= SETTLE_SECONDS
            accuser_accused = mark.accuser in accused_in.get(mark.session, set())
            if settled and mark.accuser in present and not accuser_accused:
                counts.firm.append(mark.at)
            else:
                counts.suspect.append(mark.at)
            counts.partners.add(mark.accuser)
        result[instance_id] = counts
    return result
