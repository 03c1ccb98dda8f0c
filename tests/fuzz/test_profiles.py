"""LLMFUZZ_DB (fuzz.profiles): a redis:// URL selects a Redis example database that every
machine of a campaign shares (a failure one saves, another replays first); without the redis
package, with a bad URL or an unreachable server, `llmfuzz run --profile nightly` is one line
and exit 2 before anything starts; other profiles do not need it."""
from __future__ import annotations

import sys

import pytest
from hypothesis import settings

from fuzz import profiles
from fuzz.cli.main import main

URL = "redis://localhost:6379/0"


@pytest.fixture
def restore_profile():
    prev = settings._current_profile
    yield
    settings.load_profile(prev)  # profiles.load re-registers nightly from LLMFUZZ_DB when next asked


@pytest.fixture
def redis_url(monkeypatch, tmp_path):
    """A real redis-server of this test's own (the Debian package, which .ci/run installs when
    absent), on a free port, with nothing persisted; LLMFUZZ_DB points at it."""
    import shutil
    import socket
    import subprocess
    import time

    pytest.importorskip("redis")
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        monkeypatch.setenv("LLMFUZZ_DB", url)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


class Recording:
    """FakeHarness that records the Cases it checks; each check moves `clock` (a FakeClock) 50 ms."""

    def __init__(self, clock=None) -> None:
        from fuzz_testutil import FakeHarness

        self.inner, self.cases = FakeHarness(fail_from=3, clock=clock, check_s=0.05), []

    def check(self, case):
        self.cases.append(case)
        return self.inner.check(case)

    def close(self) -> None:
        pass


def test_a_redis_url_shares_failures_between_campaigns(redis_url, restore_profile, tmp_path) -> None:
    import redis
    from hypothesis.extra.redis import RedisExampleDatabase

    from fuzz.campaign.loop import Campaign
    from fuzz_testutil import FakeClock

    assert profiles.load("nightly") == "nightly"
    assert isinstance(settings.default.database, RedisExampleDatabase)
    runs = []
    for machine in ("a", "b"):  # two machines of one campaign, one after the other
        clock = FakeClock()  # the budget is about 60 examples, however loaded the machine
        h = Recording(clock)
        s = Campaign(layouts=("tp1pp1",), modes=("eager",), budget_s=3.0, progress=False, harness=h,
                     use_database=True, out_dir=str(tmp_path / machine), shrink_budget_s=0, clock=clock).run()
        runs.append((h, s))
    (ha, sa), (hb, sb) = runs
    assert sa.failures and sb.failures
    assert len(ha.cases[0].workload.requests) < 3  # a: the simplest Case first, it passes
    assert len(hb.cases[0].workload.requests) >= 3  # b: a's failure, replayed from the shared database first
    assert any(k.startswith(b"llmfuzz-example:") for k in redis.Redis.from_url(redis_url).keys())


# Run as a separate interpreter: a shard's machine shares nothing with this one but the URL.
_SAVE_MANY = """
import sys, redis
from hypothesis.extra.redis import RedisExampleDatabase
url, tag, n = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
db = RedisExampleDatabase(redis.Redis.from_url(url), key_prefix=b"llmfuzz-example:")
for i in range(n):
    db.save(b"cell", tag + str(i).encode())
"""


def test_two_shards_write_to_one_redis_at_once_without_loss(redis_url) -> None:
    """Two processes (two shards' machines) save into the same key at once: every entry lands."""
    import subprocess
    import sys

    import redis
    from hypothesis.extra.redis import RedisExampleDatabase

    procs = [subprocess.Popen([sys.executable, "-c", _SAVE_MANY, redis_url, tag, "300"]) for tag in ("a", "b")]
    for p in procs:
        assert p.wait(timeout=60) == 0
    db = RedisExampleDatabase(redis.Redis.from_url(redis_url), key_prefix=b"llmfuzz-example:")
    assert set(db.fetch(b"cell")) == {t + str(i).encode() for t in (b"a", b"b") for i in range(300)}


def test_a_directory_is_still_the_default(monkeypatch, tmp_path, restore_profile) -> None:
    from hypothesis.database import DirectoryBasedExampleDatabase

    monkeypatch.setenv("LLMFUZZ_DB", str(tmp_path / "db"))
    profiles.load("nightly")
    assert isinstance(settings.default.database, DirectoryBasedExampleDatabase)


@pytest.mark.parametrize("url,words", [
    ("redis://127.0.0.1:1/0", "cannot reach the Redis server"),
    ("redis://localhost:port/0", "not a Redis URL"),
])
def test_bad_redis_url_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, restore_profile, url, words) -> None:
    pytest.importorskip("redis")
    monkeypatch.setenv("LLMFUZZ_DB", url)
    code = main(["run", "--profile", "nightly", "--budget", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0] and url in err[0], err
    assert not (tmp_path / "out").exists()


def test_without_the_redis_package_run_says_what_to_install(monkeypatch, capsys, tmp_path, restore_profile) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` fails as if not installed
    monkeypatch.setenv("LLMFUZZ_DB", URL)
    code = main(["run", "--profile", "nightly", "--budget", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "pip install 'llmfuzz[redis]'" in err[0] and URL in err[0] and "profile nightly" in err[0]
    assert profiles.load("dev") == "dev"  # profiles without a database do not need it
