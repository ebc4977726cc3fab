"""The short form of ``make fuzz``: seeded hostile chunks against the read path end in KV or in
the library's typed errors, never in another exception or a hang."""
from __future__ import annotations

import random

from kvcodec_tools import fuzz


def test_a_short_fuzz_run_finds_nothing():
    report = fuzz.fuzz(cases=3000, seed=12345, timeout_s=10.0)
    doc = report.to_json()
    assert doc["cases"] == 3000
    assert doc["untyped"] == 0 and doc["hangs"] == 0, doc["findings"][:3]
    # the cases reach past the tag and the digests: some decode to KV, some fail deeper
    assert doc["outcomes"].get("ok", 0) > 100 and doc["outcomes"].get("typed:ForeignChunk", 0) > 100
    assert {"field", "section", "bytes"} <= {k.split(":")[0] for k in doc["mutations"]}


def test_cases_are_reproducible_from_their_seed():
    data, other = b"KVCC" + bytes(range(200)), b"KVCC" + bytes(200)
    one = [fuzz._bytes_mutation(random.Random(i), data, other) for i in range(50)]
    two = [fuzz._bytes_mutation(random.Random(i), data, other) for i in range(50)]
    assert one == two
    assert len({kind for kind, _ in one}) >= 5 and all(out != data for _, out in one[:10] if _ != "bytes:extend")
