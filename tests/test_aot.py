"""Every kernel variant compiles to a cubin for sm_75, sm_80, sm_89 and sm_90, without a GPU.

Also reads the PTX: the inline asm is there (and does the arithmetic: no FMA anywhere), and the
small tables and (for large outputs) the output stores carry their eviction hints.
"""

import json
import os
import subprocess
import sys

import pytest

from nf4_triton import kernel

# The CPU's tier (CI compiles every variant there); on a GPU, part of the long tail (--long).
pytestmark = pytest.mark.long

HERE = os.path.dirname(os.path.abspath(__file__))
CAPABILITIES = [75, 80, 89, 90]


@pytest.fixture(scope="module", params=CAPABILITIES, ids=lambda cc: f"sm_{cc}")
def compiled(request):
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, os.path.join(HERE, "aot_compile.py"), str(request.param)],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    (count,) = [line["variants"] for line in lines if "variants" in line]
    rows = [line for line in lines if "cc" in line]
    assert count > 0 and len(rows) == count, result.stdout
    return request.param, rows


def test_cubin_for_every_variant(compiled):
    _, rows = compiled
    assert all(row["cubin_bytes"] > 0 for row in rows)
    assert {row["word_loads"] for row in rows} == {True, False}
    assert {row["shared_tables"] for row in rows} == ({True, False} if kernel.TRITON_COMPILES_SHARED_TABLES else {False})
    assert all(row["shared_loads"] > 0 for row in rows if row["shared_tables"])


def test_inline_asm_does_the_arithmetic(compiled):
    _, rows = compiled
    for row in rows:
        assert row["fma"] == 0, row
        if row["use_asm"]:
            assert row["asm_mul_ftz"] > 0, row
            assert (row["asm_add_rn"] > 0) == row["nested"], row
        else:
            assert row["asm_mul_ftz"] == row["asm_add_rn"] == 0, row


def test_eviction_hints(compiled):
    """Tables evict_last when the hints are on; output stores evict_first only for outputs of
    several L2 sizes; never a hint on the packed load (measured slower with one)."""
    _, rows = compiled
    assert {row["eviction_hints"] for row in rows} == {True, False}
    assert {row["stream_stores"] for row in rows} == {True, False}
    for row in rows:
        assert row["evict_first_loads"] == 0, row
        assert (row["evict_last_loads"] > 0) == row["eviction_hints"], row
        assert (row["evict_first_stores"] > 0) == row["stream_stores"], row
        assert not row["stream_stores"] or row["eviction_hints"], row


def test_bf16_rounding_path(compiled):
    cc, rows = compiled
    for row in rows:
        assert row["bf16_via_int"] == (cc < 80), row
