"""Redis and PostgreSQL servers of the test's own, for the drills that stop, restart or kill a server.

A drill never touches the machine's servers: the machine's Redis holds other people's databases (a
`shutdown nosave` there empties every one of them), and its PostgreSQL serves other clients. Each server
here listens on a free port of 127.0.0.1, keeps its data in a folder of its own, and is stopped and its
folder removed when the test session ends, whatever happened.

PostgreSQL refuses to run as root, so as root (CI) the cluster is made and run as the `postgres`
account, in a folder under the system temp dir that account can reach (pytest's own temp dirs are
private to their owner).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import redis

from tests.fleet_helpers import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """What a drill does to a server: stop it for a while, or restart it."""

    def up(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """Stopped for the block, started again after it whatever happens."""
        try:
            self.stop()
            yield
        finally:
            if not self.up():
                self.start()

    def restart(self, down_s: float = 0.5) -> float:
        """Stop it, wait `down_s`, start it again; the seconds it was down."""
        down = time.monotonic()
        try:
            self.stop()
            down = time.monotonic()
            time.sleep(down_s)
        finally:
            if not self.up():
                self.start()
        return time.monotonic() - down


class PrivateRedis(_Server):
    """A `redis-server` on a port of its own that keeps nothing on disk: a restart loses every key."""

    def __init__(self, root: Path) -> None:
        if shutil.which("redis-server") is None:
            raise FileNotFoundError("redis-server is not installed")
        self.root = root
        self.port = free_port()
        self.root.mkdir(parents=True, exist_ok=True)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def up(self) -> bool:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        client = redis.Redis(port=self.port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def pid(self) -> int:
        return int((self.root / "redis.pid").read_text())

    def start(self) -> None:
        args = ["redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.root)]
        args += ["--pidfile", str(self.root / "redis.pid"), "--logfile", str(self.root / "redis.log")]
        subprocess.run(args, check=True, capture_output=True, timeout=30)
        wait_for(self.up, 30, "the private Redis to start", poll=0.05)

    def stop(self) -> None:
        if self.up():
            subprocess.run(["redis-cli", "-p", str(self.port), "shutdown", "nosave"], capture_output=True, timeout=30)
            wait_for(lambda: not self.up(), 10, "the private Redis to stop")


def _postgres_bindir() -> Path:
    pg_config = shutil.which("pg_config")
    if pg_config:
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        if found and (Path(found) / "initdb").exists():
            return Path(found)
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if versions:
        return versions[-1].parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise FileNotFoundError("PostgreSQL's initdb is not installed")


class PrivatePostgres(_Server):
    """A PostgreSQL cluster made with `initdb` in a folder of its own, run by `pg_ctl` on its own port
    (TCP on 127.0.0.1 only, trust auth for the `postgres` role)."""

    def __init__(self) -> None:
        self.bindir = _postgres_bindir()
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="specq-test-pg-"))
        self.data = self.root / "data"
        if self.as_root:
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        command = [str(self.bindir / tool), *args]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def up(self) -> bool:
        try:
            with psycopg.connect(self.admin_url, connect_timeout=1) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    def pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def start(self) -> None:
        # no unix socket: the folder is the cluster's alone, and TCP on loopback is all a test needs
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories='' -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "server.log"), "-w", "start")
        wait_for(self.up, 60, "the private PostgreSQL to start")

    def stop(self) -> None:
        """Fast shutdown: every connection is cut."""
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        wait_for(lambda: not self.up(), 30, "the private PostgreSQL to stop")

    def remove(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
