"""Hypothesis profiles, selected explicitly (`LLMFUZZ_PROFILE` or `--profile`).

Hypothesis auto-loads its own `ci` profile when the CI variable is set; registering ours
under the same name replaces it, and `load()` always names the profile it wants.

The example database of the `nightly` and `repro` profiles is `LLMFUZZ_DB`: a directory
(default `.hypothesis/llmfuzz-examples`), or `redis://HOST:PORT/DB` (also `rediss://`,
`unix://`), a Redis server every machine of a sharded campaign shares as it runs
(Hypothesis' RedisExampleDatabase; the `redis` package: `pip install 'llmfuzz[redis]'`).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

PROFILES = ("dev", "ci", "nightly", "repro")
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_DB_ERROR: list[str] = []  # why LLMFUZZ_DB could not be opened (the profiles that use it are refused)


def database_path() -> str:
    return os.environ.get("LLMFUZZ_DB", os.path.join(".hypothesis", "llmfuzz-examples"))


def example_database(spec: str | None = None):
    """The database `spec` (default LLMFUZZ_DB) names: a Redis server for a redis:// URL,
    reached once here (a server that is not there is an error now, not mid-campaign), else
    a directory. ValueError, one line, naming what to install or what failed."""
    spec = spec or database_path()
    if not spec.startswith(REDIS_SCHEMES):
        return DirectoryBasedExampleDatabase(spec)
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError:
        raise ValueError(f"LLMFUZZ_DB={spec}: a Redis database needs the redis package "
                         "(pip install 'llmfuzz[redis]', or pip install redis)") from None
    try:
        client = redis.Redis.from_url(spec)
        client.ping()
    except ValueError as e:
        raise ValueError(f"LLMFUZZ_DB={spec}: not a Redis URL ({e}); e.g. redis://localhost:6379/0") from None
    except redis.RedisError as e:
        raise ValueError(f"LLMFUZZ_DB={spec}: cannot reach the Redis server ({e})") from None
    return RedisExampleDatabase(client, key_prefix=b"llmfuzz-example:")


def register() -> None:
    common = dict(deadline=None, suppress_health_check=_SUPPRESS, print_blob=True)
    settings.register_profile("dev", max_examples=25, **common)
    settings.register_profile("ci", max_examples=15, derandomize=True, database=None, **common)
    _DB_ERROR.clear()
    try:
        db = example_database()
    except ValueError as e:  # only the profiles that use it fail (`load`): dev and ci still work
        _DB_ERROR.append(str(e))
        return
    settings.register_profile("nightly", max_examples=2000, derandomize=False, database=db, **common)
    # Replay what the database holds, generate nothing new.
    settings.register_profile("repro", max_examples=1, phases=[Phase.explicit, Phase.reuse], database=db, **common)


def load(name: str | None = None) -> str:
    # Explicit choice first; on a CI machine (CI set) our own "ci" profile, never Hypothesis's.
    name = name or os.environ.get("LLMFUZZ_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    if name not in PROFILES:
        raise ValueError(f"profile: {name!r} is not one of {', '.join(PROFILES)}")
    register()
    if name in ("nightly", "repro") and _DB_ERROR:
        raise ValueError(f"profile {name}: {_DB_ERROR[0]}")
    settings.load_profile(name)
    return name


def union_databases(sources: list[str], into: str) -> int:
    """Every entry of the directory databases `sources` saved into `into` (made if missing):
    the union of a sharded night's databases (`llmfuzz merge --db`). Keys are read from each
    source's own list of its keys (Hypothesis keeps one), entries are saved through the
    database API, so `into` is a database as Hypothesis writes one. Returns the entries added."""
    into_db = DirectoryBasedExampleDatabase(into)
    os.makedirs(into, exist_ok=True)
    added = 0
    for path in sources:
        if not os.path.isdir(path):
            raise ValueError(f"--db {path}: not a directory")
        src = DirectoryBasedExampleDatabase(path)
        for key in list(src.fetch(DirectoryBasedExampleDatabase._metakeys_name)):
            have = set(into_db.fetch(key))
            for value in src.fetch(key):
                if value not in have:
                    into_db.save(key, value)
                    have.add(value)
                    added += 1
    return added
