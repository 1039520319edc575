"""kvctl as operators run it: a real child process against pools owned by other real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from elastic_kv.cli.kvctl import EXIT_BAD_ARGUMENT, EXIT_REFUSED, EXIT_REGISTRY, EXIT_TIMEOUT, EXIT_UNKNOWN
from elastic_kv.registry import Registry

from limits.helpers import PoolProcess

MiB = 1 << 20
GiB = 1 << 30
Kvctl = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def two_pools(spawn_pool: Callable[..., PoolProcess]) -> tuple[PoolProcess, PoolProcess]:
    """Pool "llama" on cuda:0 (a 80 GiB device, 4 GiB limit, statistics published) and "qwen" (no limit)."""
    llama = spawn_pool("llama", limit=4 * GiB, engine="vllm", model="meta-llama/Llama-3.1-8B", total=80 * GiB)
    qwen = spawn_pool("qwen", engine="sglang", model="Qwen/Qwen3-8B")
    assert llama.send(f"charge {3 * GiB}")["ok"]
    assert llama.send(f"publish 700 4096 {3 * GiB} 90 10")["ok"]
    assert qwen.send(f"charge {GiB}")["ok"]
    return llama, qwen


def test_list_shows_pools_and_devices(kvctl: Kvctl, two_pools: tuple[PoolProcess, PoolProcess]) -> None:
    llama, qwen = two_pools
    done = kvctl("list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:6] == ["POOL", "DEVICE", "ENGINE", "MODEL", "PID", "LIMIT"]
    llama_row = next(line for line in lines if line.startswith("llama "))
    for cell in (
        "vllm",
        "meta-llama/Llama-3.1-8B",
        str(llama.pid),
        "4.00 GiB",
        "3.00 GiB",
        "700/4096",
        "90%",
    ):
        assert cell in llama_row
    qwen_row = next(line for line in lines if line.startswith("qwen "))
    assert "unlimited" in qwen_row and "starting" in qwen_row and str(qwen.pid) in qwen_row
    device_row = next(line for line in lines if line.startswith("cuda:0 "))
    assert device_row.split()[:2] == ["cuda:0", "unlimited"] and "80.0 GiB" in device_row


def test_list_json(kvctl: Kvctl, two_pools: tuple[PoolProcess, PoolProcess]) -> None:
    done = kvctl("list", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    pools = {p["name"]: p for p in doc["pools"]}
    assert set(pools) == {"llama", "qwen"}
    assert pools["llama"]["charged_bytes"] == 3 * GiB
    assert pools["llama"]["snapshot"]["used_blocks"] == 700
    assert pools["llama"]["snapshot"]["schema"] == "elastic_kv.pool_snapshot.v1"
    assert pools["qwen"]["snapshot"] is None
    assert doc["devices"] == [
        {"device": "cuda:0", "budget_bytes": 0, "budget_revision": 0, "total_bytes": 80 * GiB,
         "charged_bytes": 4 * GiB, "pools": ["llama", "qwen"]}
    ]  # fmt: skip


def test_limit_sizes_and_percentages(
    kvctl: Kvctl, registry_dir: Path, two_pools: tuple[PoolProcess, PoolProcess]
) -> None:
    llama, _ = two_pools
    done = kvctl("limit", "llama", "2GiB")
    assert done.returncode == 0, done.stderr
    assert "limit 2.00 GiB (was 4.00 GiB)" in done.stdout
    assert "the engine frees the pages to be released" in done.stdout  # 3 GiB charged > 2 GiB
    assert llama.send("poll")["limit_changed"]
    assert llama.send("poll")["limit"] == 2 * GiB
    # A percentage is of the device's size while no budget is set, then of the budget.
    assert kvctl("limit", "llama", "10%").returncode == 0
    assert Registry(registry_dir).pool("llama").limit_bytes == 8 * GiB
    assert kvctl("budget", "cuda:0", "50%").returncode == 0  # of the 80 GiB device
    assert Registry(registry_dir).device("cuda:0").budget_bytes == 40 * GiB
    assert kvctl("limit", "llama", "25%").returncode == 0
    assert Registry(registry_dir).pool("llama").limit_bytes == 10 * GiB
    assert kvctl("limit", "llama", "unlimited").returncode == 0
    assert Registry(registry_dir).pool("llama").limit_bytes == 0


def test_budget_show_set_and_effect_on_charges(
    kvctl: Kvctl, two_pools: tuple[PoolProcess, PoolProcess], registry_dir: Path
) -> None:
    llama, qwen = two_pools
    done = kvctl("budget", "cuda:0", "4G")
    assert done.returncode == 0, done.stderr
    assert "budget 4.00 GiB, charged 4.00 GiB by 2 pool(s)" in done.stdout
    assert qwen.send("poll")["limit_changed"]
    assert not qwen.send("charge 1")["ok"]  # the device is at its budget
    done = kvctl("budget", "cuda:0", "3G")
    assert "none can grow until they release enough" in done.stdout
    done = kvctl("budget", "cuda:0")
    assert done.returncode == 0 and "budget 3.00 GiB" in done.stdout
    assert kvctl("budget", "cuda:0", "none").returncode == 0
    assert qwen.send(f"charge {GiB}")["ok"]
    # An operator may set a budget before any engine uses the device, saying so with --create; without
    # it, a name no pool has used is refused (a typo must not create a budget that protects nothing).
    fresh = "GPU-0f3c2b1a-1111-2222-3333-444455556666"
    done = kvctl("budget", fresh, "60GiB")
    assert done.returncode == EXIT_UNKNOWN
    assert "no pool has used device" in done.stderr and "--create" in done.stderr
    assert fresh not in {d.device for d in Registry(registry_dir).devices()}
    done = kvctl("budget", fresh, "60GiB", "--create")
    assert done.returncode == 0, done.stderr
    assert llama.send("state")["charged"] == 3 * GiB


def test_trim_reaches_the_owner(kvctl: Kvctl, two_pools: tuple[PoolProcess, PoolProcess]) -> None:
    llama, qwen = two_pools
    done = kvctl("trim", "qwen", "--wait", "0.2")  # a worker process that never answers: no wait forever
    assert done.returncode == 0, done.stderr
    assert "trim requested" in done.stdout and "no answer in 0.2 s" in done.stdout
    events = qwen.send("poll")
    assert events["trim_requested"] and not events["limit_changed"]
    assert not llama.send("poll")["trim_requested"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("limit", "nope", "1G"), EXIT_UNKNOWN, "no pool named 'nope'.*pools: llama, qwen"),
        (("trim", "nope"), EXIT_UNKNOWN, "no pool named 'nope'"),
        (("budget", "cuda:7"), EXIT_UNKNOWN, "no budget for device 'cuda:7'.*known devices: cuda:0"),
        (("limit", "llama", "12X"), EXIT_BAD_ARGUMENT, "invalid size '12X'"),
        (("limit", "llama", "--", "-1G"), EXIT_BAD_ARGUMENT, "invalid size"),
        (("limit", "llama", "-1G"), EXIT_BAD_ARGUMENT, "invalid size '-1G': it is negative"),
        (("budget", "cuda:0", "-5G"), EXIT_BAD_ARGUMENT, "invalid size '-5G': it is negative"),
        (("budget", "cuda:0", "-.5M"), EXIT_BAD_ARGUMENT, "it is negative"),
        (("limit", "llama", "-10%"), EXIT_BAD_ARGUMENT, "invalid percentage '-10%': it is negative"),
        (("limit", "llama", "1.5"), EXIT_BAD_ARGUMENT, "whole number of bytes"),
        (
            ("limit", "llama", "1M"),
            EXIT_BAD_ARGUMENT,
            "below one page of pool llama .2.00 MiB.: .*at least 2.00 MiB",
        ),
        (("limit", "llama", "150%"), EXIT_BAD_ARGUMENT, "at most 100%"),
        (("limit", "llama", "0"), EXIT_BAD_ARGUMENT, "'unlimited'"),
        (("limit", "qwen", "0.0000000001%"), EXIT_BAD_ARGUMENT, "0 bytes"),
        (("limit", "bad/name", "1G"), EXIT_BAD_ARGUMENT, "invalid pool name"),
        (("budget", "cuda/0", "1G"), EXIT_BAD_ARGUMENT, "invalid device name"),
        (("budget", "cuda:5", "10%"), EXIT_UNKNOWN, "no pool has used device 'cuda:5'"),
        (("budget", "cuda:5", "10%", "--create"), EXIT_BAD_ARGUMENT, "size of device cuda:5 is unknown"),
        (("watch", "-n", "0"), EXIT_BAD_ARGUMENT, "interval must be positive"),
        (("frobnicate",), EXIT_BAD_ARGUMENT, "invalid choice"),
        ((), EXIT_BAD_ARGUMENT, "required"),
    ],
)
def test_errors_have_clear_messages_and_exit_codes(
    kvctl: Kvctl, two_pools: tuple[PoolProcess, PoolProcess], args: tuple[str, ...], code: int, message: str
) -> None:
    done = kvctl(*args)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert re.search(message, done.stderr), done.stderr
    assert "Traceback" not in done.stderr


def test_limit_wait_says_when_the_pool_did_not_get_under_it(
    kvctl: Kvctl, two_pools: tuple[PoolProcess, PoolProcess]
) -> None:
    """This owner never releases: --wait gives up after its time, says so, and exits 5."""
    done = kvctl("limit", "llama", "2G", "--wait", "0.3")
    assert done.returncode == EXIT_TIMEOUT, (done.stdout, done.stderr)
    assert "not applied within 0.3 s: the pool still holds 3.00 GiB (limit 2.00 GiB)" in done.stdout


def test_percentage_limit_without_budget_or_size_is_refused(
    kvctl: Kvctl, spawn_pool: Callable[..., PoolProcess]
) -> None:
    spawn_pool("lonely", device="cuda:3")  # no --total: the device's size is unknown
    done = kvctl("limit", "lonely", "20%")
    assert done.returncode == EXIT_BAD_ARGUMENT
    assert "kvctl budget cuda:3 SIZE" in done.stderr


def test_unusable_registry_directory_exits_4(tmp_path: Path, child_env: dict[str, str]) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o755)
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv.cli.kvctl", "--registry-dir", str(loose), "list"],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == EXIT_REGISTRY
    assert "chmod 700" in done.stderr


def test_kvctl_reads_no_setting_it_does_not_use(
    registry_dir: Path, child_env: dict[str, str], two_pools: tuple[PoolProcess, PoolProcess]
) -> None:
    """A bad engine setting in the operator's shell concerns the engines, not kvctl."""
    env = {**child_env, "ELASTIC_KV_PAGE_SIZE": "abc", "ELASTIC_KV_LIMIT": "-1"}
    done = subprocess.run(
        [sys.executable, "-m", "elastic_kv.cli.kvctl", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "\nllama " in done.stdout
    assert "PAGE_SIZE" not in done.stderr


def test_corrupt_record_is_moved_aside_not_deleted(
    kvctl: Kvctl, registry_dir: Path, two_pools: tuple[PoolProcess, PoolProcess]
) -> None:
    garbage = b"not a pool record" * 10
    (registry_dir / "broken.pool").write_bytes(garbage)
    done = kvctl("list")
    assert done.returncode == 0, done.stderr
    assert not (registry_dir / "broken.pool").exists()
    assert (registry_dir / "broken.pool.corrupt").read_bytes() == garbage
    assert "broken.pool" in done.stderr and "moved it to" in done.stderr
    assert "\nllama " in done.stdout and "broken" not in done.stdout
    # A second corrupt record of the same name does not overwrite the first one kept aside.
    (registry_dir / "broken.pool").write_bytes(b"x")
    assert kvctl("list").returncode == 0
    assert (registry_dir / "broken.pool.corrupt").read_bytes() == garbage
    assert (registry_dir / "broken.pool.corrupt.2").read_bytes() == b"x"


def test_empty_registry(kvctl: Kvctl) -> None:
    done = kvctl("list")
    assert done.returncode == 0 and done.stdout.strip() == "no elastic-kv pools"
    assert json.loads(kvctl("list", "--json").stdout) == {"pools": [], "devices": []}


def test_watch_prints_periodically(kvctl: Kvctl, two_pools: tuple[PoolProcess, PoolProcess]) -> None:
    done = kvctl("watch", "-n", "0.05", "--count", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("--- ") == 3
    assert done.stdout.count("\nllama ") == 3


def test_top_draws_a_table(kvctl: Kvctl, two_pools: tuple[PoolProcess, PoolProcess]) -> None:
    done = kvctl("top", "-n", "0.05", "--count", "2")
    assert done.returncode == 0, done.stderr
    for text in ("devices", "pools", "llama", "qwen", "cuda:0", "3.00 GiB", "700/4096", "90%", "starting"):
        assert text in done.stdout, text


def test_a_pool_that_cannot_follow_a_limit_refuses_one(kvctl: Kvctl, registry_dir: Path) -> None:
    """SGLang's Mamba state pool: its engine fails where it cannot get a state slot, so its record follows
    no limit; kvctl says so in one line and changes nothing, and lists it as budget-only."""
    from elastic_kv.registry import LimitNotFollowedError, PoolRecord

    with PoolRecord.create(
        "gdn-mamba", device="cpu", engine="sglang", model="mamba-2l", limit_bytes=0,
        registry_dir=registry_dir, follows_limit=False,
    ):  # fmt: skip
        done = kvctl("limit", "gdn-mamba", "1G")
        assert done.returncode == EXIT_BAD_ARGUMENT, (done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and "cannot follow a limit" in done.stderr, done.stderr
        assert "limit the engine's KV cache pool instead" in done.stderr
        registry = Registry(registry_dir)
        assert registry.pool("gdn-mamba").limit_bytes == 0 and registry.pool("gdn-mamba").limit_revision == 0
        with pytest.raises(LimitNotFollowedError):
            registry.set_limit("gdn-mamba", 1 << 30)
        assert registry.set_limit("gdn-mamba", 0).limit_bytes == 0  # "unlimited" is what it follows
        assert "none (budget only)" in kvctl("list").stdout
        assert "none (budget only)" in kvctl("top", "-n", "0.05", "--count", "1").stdout
        listed = json.loads(kvctl("list", "--json").stdout)["pools"]
        assert [p["follows_limit"] for p in listed] == [False]
    with pytest.raises(ValueError, match="follows no limit"):
        PoolRecord.create(
            "gdn-mamba", device="cpu", engine="sglang", model="m", limit_bytes=1 << 20,
            registry_dir=registry_dir, follows_limit=False,
        )  # fmt: skip


@pytest.fixture
def busy_pool(spawn_pool: Callable[..., PoolProcess]) -> PoolProcess:
    """Pool "alpha" on cuda:0 whose engine published that its largest request needs 6 MiB (3 pages)."""
    alpha = spawn_pool("alpha", engine="vllm", total=80 * GiB)
    assert alpha.send(f"charge {8 * MiB}")["ok"]
    assert alpha.send(f"publish 12 4096 {8 * MiB} 0 0 0 {6 * MiB}")["ok"]
    return alpha


def test_a_limit_below_the_largest_request_is_refused_in_one_line(
    kvctl: Kvctl, registry_dir: Path, busy_pool: PoolProcess
) -> None:
    done = kvctl("limit", "alpha", "4M")
    assert done.returncode == EXIT_REFUSED, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert re.fullmatch(
        r"kvctl: refused: a limit of 4.00 MiB is below the 6.00 MiB that the largest request of pool alpha "
        r"needs to run alone: .*give at least 6.00 MiB, or add --force.*\n",
        done.stderr,
    ), done.stderr
    assert Registry(registry_dir).pool("alpha").limit_bytes == 0  # nothing changed
    done = kvctl("limit", "alpha", "6M")  # exactly what it needs
    assert done.returncode == 0, done.stderr
    assert Registry(registry_dir).pool("alpha").limit_bytes == 6 * MiB


def test_force_applies_such_a_limit_with_a_one_line_warning(
    kvctl: Kvctl, registry_dir: Path, busy_pool: PoolProcess
) -> None:
    done = kvctl("limit", "alpha", "4M", "--force")
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        "kvctl: warning: requests of pool alpha that need more than 4.00 MiB cannot run under this limit and "
        "end with an error (the largest needs 6.00 MiB)\n"
    )
    assert "limit 4.00 MiB (was unlimited)" in done.stdout
    assert Registry(registry_dir).pool("alpha").limit_bytes == 4 * MiB


def test_a_budget_below_a_pools_largest_request_is_refused_or_forced(
    kvctl: Kvctl, registry_dir: Path, busy_pool: PoolProcess, spawn_pool: Callable[..., PoolProcess]
) -> None:
    idle = spawn_pool("idle", engine="sglang")  # same device, no request: needs nothing
    assert idle.send(f"publish 0 4096 {2 * MiB} 0 0")["ok"]
    done = kvctl("budget", "cuda:0", "5M")
    assert done.returncode == EXIT_REFUSED, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1, done.stderr
    refusal = "refused: a budget of 5.00 MiB for device cuda:0 is below what the largest request of pool(s) "
    assert refusal in done.stderr
    assert "alpha 6.00 MiB" in done.stderr and "idle" not in done.stderr
    assert Registry(registry_dir).device("cuda:0").budget_bytes == 0
    done = kvctl("budget", "cuda:0", "5M", "--force")
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("kvctl: warning: requests that need more than 5.00 MiB cannot run")
    assert done.stderr.count("\n") == 1
    assert Registry(registry_dir).device("cuda:0").budget_bytes == 5 * MiB
    assert kvctl("budget", "cuda:0", "unlimited").returncode == 0  # lifting is never refused


def test_help_documents_the_refusal_and_its_exit_code(kvctl: Kvctl) -> None:
    done = kvctl("limit", "--help")
    assert done.returncode == 0 and "--force" in done.stdout
    done = kvctl("--help")
    assert "6 refused" in " ".join(done.stdout.split())
