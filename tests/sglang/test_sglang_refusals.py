"""What the elastic backend does not serve fails the real engine's start-up with one line saying why,
instead of running native behind the user's back (or writing KV to unbacked memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.sglang_engine import LOG_DIR, start_engine

pytestmark = pytest.mark.sglang


def test_speculative_decoding_is_refused_at_start_up(tiny_model_path: Path, tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    with pytest.raises(RuntimeError, match="engine failed to start"):
        start_engine(
            "refused-ngram",
            tiny_model_path,
            backend="elastic",
            env={"ELASTIC_KV_REGISTRY_DIR": str(tmp_path)},
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=4,
        ).close()
    lines = (LOG_DIR / "refused-ngram.log").read_text().splitlines()
    reasons = [line for line in lines if line.startswith("elastic_kv.errors.ConfigError:")]
    assert reasons, "\n".join(lines[-40:])
    # The whole reason on one line: what is refused, why, and what to use instead.
    assert "does not serve speculative decoding (--speculative-algorithm NGRAM)" in reasons[0]
    assert reasons[0].endswith("use --kv-cache-backend=native")
