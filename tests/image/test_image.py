"""The image built and run for real: jobs of containers, one preempted and resumed.

Podman (installed with apt where missing) builds a stand-in for the official
``python:3.11-slim-bookworm`` base from a debootstrapped Debian, then the
project's ``Dockerfile`` unchanged except for ``--build-arg BASE`` and the CPU
lock; every job's tasks then run as containers of that image on an internal
podman network, ``TF_CONFIG`` naming the containers, the run directory on a
volume. The commands are the ones docs/deployment.md gives.

Nothing is left on the host: podman's storage, run state and configuration
live in the test's temporary directory, and every podman command runs in a
private mount namespace (tmpfs over the paths podman and the CNI plugins keep
host-wide state in: /var/lib/cni, /var/lib/containers, /dev/shm, /run/netns);
the containers' network side lives in a private network namespace, so the
bridge and its firewall rules go with it. Builds use the host's network (pip
and apt need the internet), containers the internal network only. At the end
every container, network, volume and image is removed, checked, and the
namespaces, the cgroups and the directory go.

Run it with ``make test-image`` (``pytest -m image``); ``make test`` leaves it out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import Proc, descendants_alive

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STANDIN = HERE / "python-standin.Containerfile"
PACKAGES = ["podman", "buildah", "runc", "fuse-overlayfs", "slirp4netns", "containernetworking-plugins",
            "golang-github-containernetworking-plugin-dnsname", "debootstrap"]
IMAGE = "localhost/tf-distribute-showcase:cpu"
BASE = "localhost/python:3.11-slim-bookworm"  # the stand-in, under the official image's name
PORT = 2222  # the Dockerfile's EXPOSE, the manifests' port
LOGREG = ["--model", "logreg", "--log-every", "100"]
LOGREG_BAR = 0.85  # logreg after 200-1500 steps: 0.90-0.93 measured in containers

# Not `multiprocess`: `-m multiprocess` must not pull this tier into a run.
pytestmark = [pytest.mark.image, pytest.mark.timeout(1200)]


def _report(request, line: str) -> None:
    """A figure on the terminal whatever pytest's capture (make test-image shows them)."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.getplugin("terminalreporter"), plugins.getplugin("capturemanager")
    if reporter is None or capture is None:
        print(f"[image] {line}")
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(f"[image] {line}")


def _why_no_containers() -> str | None:
    """Why this OS cannot run containers at all, or None."""
    if sys.platform != "linux":
        return "containers need Linux"
    if os.geteuid() != 0:
        return "root is needed (rootful podman, apt, namespaces)"
    probe = subprocess.run(["unshare", "--mount", "--net", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"the OS forbids mount/network/PID namespaces: {probe.stderr.decode().strip()}"
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        return "podman is missing and there is no apt-get to install it"
    return None


def _install_podman(log: Path) -> None:
    missing = [t for t in ("podman", "runc", "debootstrap", "fuse-overlayfs") if shutil.which(t) is None]
    if not missing and Path("/usr/lib/cni/bridge").exists():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(log, "w") as out:
        rc = subprocess.run("apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                            + " ".join(PACKAGES), shell=True, stdout=out, stderr=subprocess.STDOUT,
                            env=env, timeout=600).returncode
    assert rc == 0, f"apt-get install podman... failed (exit {rc}):\n{log.read_text()[-3000:]}"


def _debian_mirror() -> str:
    """The Debian mirror apt uses here (debootstrap fetches the base from it)."""
    texts = [p.read_text() for p in [Path("/etc/apt/sources.list"),
                                     *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
             if p.is_file()]
    for uri in re.findall(r"(?:URIs:|^deb)\s+(?:\[[^\]]*\]\s+)?(https?://\S+)", "\n".join(texts), re.M):
        if uri.rstrip("/").endswith("/debian"):
            return uri
    return "http://deb.debian.org/debian"


def _mnist_dir() -> Path:
    """A tfds directory holding MNIST, mounted read-only into the containers (they have no internet)."""
    data = Path(os.environ.get("TFDS_DATA_DIR") or Path.home() / "tensorflow_datasets")
    if not (data / "mnist").is_dir():  # what the other tests' first run does: download it
        subprocess.run([sys.executable, "-c", "import sys, tensorflow_datasets as tfds; "
                        "tfds.builder('mnist', data_dir=sys.argv[1]).download_and_prepare()", str(data)],
                       check=True, timeout=600)
    return data.resolve()


class Podman:
    """podman with its state under ``state`` and its namespaces held by one process."""

    def __init__(self, state: Path):
        self.state = state
        self.cgroup_parent = f"/tfdist-image-{uuid.uuid4().hex[:8]}"
        # An image build (buildah) makes a cgroup of its own in every controller and
        # leaves it behind: the ones that were not there before are this run's.
        self.build_cgroups_before = set(Path("/sys/fs/cgroup").glob("*/buildah-*"))
        (state / "tmp").mkdir()
        (state / "cni").mkdir()
        conf = state / "containers.conf"
        conf.write_text(f"""\
[containers]
# Without them: "setrlimit RLIMIT_NOFILE: Operation not permitted" on these hosts.
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
# crun 1.8 refuses hybrid cgroups (v1 beside a v2 mount); runc does not.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{state}/events.log"
tmp_dir = "{state}/tmp"

[network]
network_config_dir = "{state}/cni"
""")
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf), "TMPDIR": str(state / "tmp")}
        self.base = ["podman", "--root", str(state / "root"), "--runroot", str(state / "runroot"),
                     "--storage-driver", "overlay"]
        # The namespaces: tmpfs over podman's and CNI's host-wide state, and a
        # network namespace for the containers' bridge. They vanish with the holder.
        tmpfs = " && ".join(f"mkdir -p {d} && mount -t tmpfs -o mode=0755 tmpfs {d}"
                            for d in ("/var/lib/cni", "/var/lib/containers", "/dev/shm", "/run/netns"))
        created = [d for d in ("/var/lib/cni", "/var/lib/containers", "/run/netns") if not Path(d).exists()]
        self.holder = Proc(["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c",
                            f"{tmpfs} && ip link set lo up && echo ready && exec sleep infinity"],
                           env=self.env)
        self.holder.wait_for_line("^ready$", 30)
        # Mount points made on the host for the tmpfs mounts: removed at the end.
        self.created_dirs = [Path(d) for d in created]
        self.containers: list[str] = []
        self.networks: list[str] = []
        self.volumes: list[str] = []
        self.images: list[str] = []

    def cmd(self, *args: str, net: bool = True) -> list[str]:
        """The podman command line; ``net=False`` (builds): the host's network."""
        enter = ["nsenter", "-t", str(self.holder.proc.pid), "-m", *(["-n"] if net else []),
                 f"--wd={self.state}"]
        return [*enter, *self.base, *args]

    def __call__(self, *args: str, net: bool = True, timeout: float = 120, check: bool = True,
                 log: Path | None = None) -> subprocess.CompletedProcess:
        if log is None:
            proc = subprocess.run(self.cmd(*args, net=net), env=self.env, capture_output=True, text=True,
                                  timeout=timeout)
        else:  # builds: their output is long, kept in a file for the failure message
            with open(log, "w") as out:
                proc = subprocess.run(self.cmd(*args, net=net), env=self.env, stdout=out,
                                      stderr=subprocess.STDOUT, text=True, timeout=timeout)
            proc.stdout, proc.stderr = log.read_text(), ""
        if check:
            assert proc.returncode == 0, f"podman {' '.join(args)}: exit {proc.returncode}\n" \
                                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        return proc

    def follow(self, container: str) -> Proc:
        """``podman logs -f``: the container's output line by line as it comes."""
        return Proc(self.cmd("logs", "-f", container), env=self.env)

    def logs(self, container: str) -> list[str]:
        """The container's output (train.py's stdout, then its stderr)."""
        proc = self("logs", container)
        return proc.stdout.splitlines() + proc.stderr.splitlines()

    def teardown(self) -> list[str]:
        """Remove all that was made; what could not be removed, as messages."""
        problems = []
        steps = [(["rm", "--force", "--time=0", "--ignore"], self.containers),
                 (["network", "rm", "--force"], self.networks), (["volume", "rm", "--force"], self.volumes),
                 (["rmi", "--force", "--ignore"], self.images[::-1])]
        # Then the build cache's intermediate images: this storage holds only what the test made.
        steps += [(["image", "prune", "--all", "--force"], [])] if self.images else []
        for args, names in steps:
            if args[0] != "image" and not names:
                continue  # nothing of that kind was made
            proc = self(*args, *names, check=False, timeout=300)
            if proc.returncode != 0:
                problems.append(f"podman {' '.join(args)}: {proc.stderr.strip()}")
        for what, args in [("containers", ["ps", "-a", "-q"]), ("volumes", ["volume", "ls", "-q"]),
                           ("images", ["images", "-a", "-q"])]:
            left = self(*args, check=False).stdout.split()
            if left:
                problems.append(f"{what} left: {left}")
        networks = set(self("network", "ls", "-q", "--format", "{{.Name}}", check=False).stdout.split())
        if networks - {"podman"}:  # "podman" is the built-in default, a configuration only
            problems.append(f"networks left: {sorted(networks - {'podman'})}")
        self.holder.kill()
        # conmon and the containers: gone with the containers (zombies reaped by init).
        deadline = time.monotonic() + 30
        while (left := descendants_alive(str(self.state))) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left:
            problems.append(f"processes left: {left}")
        # The containers' and conmon's cgroups, one tree per controller (cgroup v1).
        for cgroup in Path("/sys/fs/cgroup").glob(f"*{self.cgroup_parent}"):
            for d in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [cgroup]:
                try:
                    d.rmdir()
                except OSError as err:
                    problems.append(f"cgroup {d}: {err}")
        for d in sorted(set(Path("/sys/fs/cgroup").glob("*/buildah-*")) - self.build_cgroups_before):
            try:
                d.rmdir()
            except OSError as err:
                problems.append(f"build cgroup {d}: {err}")
        for d in self.created_dirs:
            try:
                d.rmdir()
            except OSError as err:
                problems.append(f"{d}: {err}")
        try:
            shutil.rmtree(self.state)
        except OSError as err:
            problems.append(f"podman's state {self.state}: {err}")
        return problems


def _ignored(rel: str, patterns: list[str]) -> bool:
    """.dockerignore's rule: out if the path or a parent matches (the patterns used here)."""
    parts = rel.split("/")
    for pattern in patterns:
        rx = re.escape(pattern.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(rx, "/".join(parts[: i + 1])) for i in range(len(parts))):
            return True
    return False


def _build_context(dest: Path) -> Path:
    """The repository as the build sees it (.dockerignore applied), in ``dest``.

    A copy, so that a source file can be edited for the rebuild without
    touching the checkout (and without walking .venv for every build).
    """
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [l.strip() for l in lines if l.strip() and not l.startswith("#")]
    for top, dirs, files in os.walk(ROOT):
        rel_top = Path(top).relative_to(ROOT)
        dirs[:] = [d for d in dirs if not _ignored((rel_top / d).as_posix(), patterns)]
        for name in files:
            rel = (rel_top / name).as_posix()
            if not _ignored(rel, patterns):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)
    return dest


def _steps(log: str) -> list[tuple[str, bool]]:
    """(instruction, from cache) per step of a ``podman build`` log."""
    found = []
    for block in re.split(r"^(?=STEP \d+/\d+: )", log, flags=re.M)[1:]:
        first, _, rest = block.partition("\n")
        found.append((first.split(": ", 1)[1], "--> Using cache" in rest))
    return found


@pytest.fixture(scope="module")
def podman(tmp_path_factory, request):
    why_not = _why_no_containers()
    if why_not:
        pytest.skip(f"no container tier: {why_not}")
    state = tmp_path_factory.mktemp("podman")
    _install_podman(state / "apt.log")
    p = Podman(state)
    try:
        yield p
    finally:
        problems = p.teardown()
        assert not problems, "left behind: " + "; ".join(problems)


@pytest.fixture(scope="module")
def image(podman, tmp_path_factory, request):
    """The CPU image, built twice (the second time after a source edit); the figures."""
    work = tmp_path_factory.mktemp("build")
    figures = {}
    # The base: Debian bookworm minbase, imported (no registry), then the stand-in.
    rootfs = work / "rootfs"
    started = time.monotonic()
    boot = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), _debian_mirror()],
                          capture_output=True, text=True, timeout=600)
    assert boot.returncode == 0, boot.stdout[-3000:] + boot.stderr[-3000:]
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    podman.images.append("localhost/debian:bookworm-minbase")
    imported = subprocess.run(podman.cmd("import", "--change", 'CMD ["/bin/bash"]', "-",
                                         "localhost/debian:bookworm-minbase", net=False),
                              stdin=tar.stdout, env=podman.env, capture_output=True, text=True, timeout=300)
    tar.stdout.close()
    assert tar.wait(60) == 0 and imported.returncode == 0, imported.stderr
    shutil.rmtree(rootfs)
    podman.images.append(BASE)
    podman("build", "--pull=never", "--network=host", "-t", BASE, "-f", str(STANDIN), str(HERE),
           net=False, timeout=600, log=work / "standin.log")
    figures["base_seconds"] = round(time.monotonic() - started, 1)

    # The project's Dockerfile, unchanged: only the base and the lock are build arguments.
    # The host's CA certificates: pip verifies TLS against them (a proxy may re-sign).
    build = ["build", "--pull=never", "--network=host", "-v", "/etc/ssl/certs:/etc/ssl/certs:ro",
             "--build-arg", f"BASE={BASE}", "--build-arg", "REQUIREMENTS=requirements-cpu.lock"]
    context = _build_context(work / "context")
    assert (context / "Dockerfile").read_bytes() == (ROOT / "Dockerfile").read_bytes()
    podman.images.append(IMAGE)
    started = time.monotonic()
    first = podman(*build, "-t", IMAGE, str(context), net=False, timeout=1200, log=work / "build1.log")
    figures["first_build_seconds"] = round(time.monotonic() - started, 1)

    # One source file edited: the dependency layer must come from the cache.
    with open(context / "train.py", "a") as f:
        f.write("\n# edited\n")
    podman.images.append(IMAGE + "-edited")
    started = time.monotonic()
    second = podman(*build, "-t", IMAGE + "-edited", str(context), net=False, timeout=1200,
                    log=work / "build2.log")
    figures["rebuild_seconds"] = round(time.monotonic() - started, 1)
    for name, size in [("image_bytes", IMAGE), ("base_bytes", BASE)]:
        figures[name] = int(podman("image", "inspect", "--format", "{{.Size}}", size).stdout)
    figures["steps"] = (_steps(first.stdout), _steps(second.stdout))
    _report(request, f"stand-in base {figures['base_bytes'] / 1e6:.0f} MB built in {figures['base_seconds']} s; "
                     f"CPU image {figures['image_bytes'] / 1e9:.2f} GB, first build {figures['first_build_seconds']} s, "
                     f"rebuild after editing train.py {figures['rebuild_seconds']} s")
    return figures


class Job:
    """One job's tasks as containers on the internal network, its run directory on a volume."""

    def __init__(self, podman: Podman, network: dict, name: str, cluster: dict[str, int],
                 strategy: str, train_args: list[str], mnist: Path):
        self.podman, self.name = podman, name
        self.tasks = [(kind, i) for kind, n in cluster.items() for i in range(n)]
        self.volume = f"{name}-runs"
        podman.volumes.append(self.volume)
        podman("volume", "create", self.volume)
        spec = {kind: [f"{self.host(kind, i)}:{PORT}" for i in range(n)] for kind, n in cluster.items()}
        hosts = [f"--add-host={self.host(k, i)}:{network['ip']()}" for k, i in self.tasks]
        self.model_dir = f"/workspace/{name}"
        for (kind, i), host in zip(self.tasks, hosts):
            tf_config = {"cluster": spec, "task": {"type": kind, "index": i}}
            podman.containers.append(self.host(kind, i))
            podman("create", "--name", self.host(kind, i), "--hostname", self.host(kind, i),
                   f"--cgroup-parent={podman.cgroup_parent}",
                   "--network", network["name"], "--ip", host.rsplit(":", 1)[1], *hosts,
                   "-v", f"{self.volume}:/workspace", "-v", f"{mnist}:/data/tfds:ro",
                   "-e", "TFDS_DATA_DIR=/data/tfds", "-e", f"TF_CONFIG={json.dumps(tf_config)}",
                   IMAGE, "--strategy", strategy, *train_args, "--model-dir", self.model_dir)

    def host(self, kind: str, index: int) -> str:
        return f"{self.name}-{kind}-{index}"

    @property
    def containers(self) -> list[str]:
        return [self.host(k, i) for k, i in self.tasks]

    def start(self) -> None:
        self.podman("start", *self.containers)

    def wait(self, timeout: float) -> dict[str, int]:
        """Every container's exit code once all have stopped."""
        codes = self.podman("wait", *self.containers, timeout=timeout).stdout.split()
        return dict(zip(self.containers, map(int, codes)))

    def run_dir(self) -> Path:
        mount = self.podman("volume", "inspect", "--format", "{{.Mountpoint}}", self.volume).stdout.strip()
        return Path(mount) / self.model_dir.removeprefix("/workspace/")

    def results(self) -> dict:
        return json.loads((self.run_dir() / "results.json").read_text())

    def output(self) -> str:
        return "\n".join(f"== {c}\n" + "\n".join(self.podman.logs(c)[-30:]) for c in self.containers)


@pytest.fixture(scope="module")
def network(podman):
    """An internal podman network: the containers reach each other and nothing else."""
    name = f"tfdist-{uuid.uuid4().hex[:6]}"
    podman.networks.append(name)
    podman("network", "create", "--internal", name)
    info = json.loads(podman("network", "inspect", name).stdout)[0]
    assert info["internal"] is True
    prefix = info["subnets"][0]["subnet"].rsplit(".", 1)[0]  # a /24: x.y.z.0/24
    counter = iter(range(10, 250))
    return {"name": name, "ip": lambda: f"{prefix}.{next(counter)}"}


@pytest.fixture(scope="module")
def mnist():
    return _mnist_dir()


def _done_hashes(lines: list[str]) -> list[str]:
    return [l.rsplit("weights_sha256=", 1)[1] for l in lines if "weights_sha256=" in l]


def test_the_image_builds_and_a_source_edit_reuses_the_dependency_layer(image):
    first, second = image["steps"]
    assert [s for s, _ in first] == [s for s, _ in second]
    deps = next(i for i, (s, _) in enumerate(first) if "--require-hashes" in s)
    package = next(i for i, (s, _) in enumerate(first) if re.search(r"pip install .*\s\.$", s))
    # Second build: every step after FROM up to the dependencies from the cache, the
    # edited sources' layers rebuilt.
    assert second[0][0].startswith("FROM ") and all(cached for _, cached in second[1: deps + 1]), second
    assert not second[package][1], "the package layer must be rebuilt after a source edit"
    assert not first[deps][1], "the first build installs the dependencies itself"
    assert image["image_bytes"] > image["base_bytes"] > 0


def test_containers_run_as_the_unprivileged_user_and_reach_nothing_outside(podman, image, network):
    """Inside the job network: uid 1000, no route out (ENETUNREACH, not a timeout)."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    podman.containers.append(name)
    code = ("import errno, os, socket\n"
            "print('uid', os.getuid(), 'home', os.path.expanduser('~'), 'cwd', os.getcwd())\n"
            "for addr in ('1.1.1.1', '8.8.8.8'):\n"
            "    s = socket.socket(); s.settimeout(5)\n"
            "    try:\n"
            "        s.connect((addr, 443)); print('reached', addr)\n"
            "    except OSError as e:\n"
            "        print('unreachable', addr, errno.errorcode.get(e.errno, e))\n")
    out = podman("run", "--name", name, f"--cgroup-parent={podman.cgroup_parent}", "--network",
                 network["name"], "--entrypoint", "python", IMAGE, "-c", code, timeout=120).stdout
    assert "uid 1000 home /home/trainer cwd /workspace" in out, out
    assert out.count("unreachable") == 2 and out.count("ENETUNREACH") == 2, out
    user = podman("image", "inspect", "--format", "{{.Config.User}}", IMAGE).stdout.strip()
    assert user == "1000"
    podman("rm", name)


def test_multiworker_job_of_two_containers(podman, image, network, mnist):
    job = Job(podman, network, "mw", {"worker": 2}, "multiworker", [*LOGREG, "--steps", "200"], mnist)
    job.start()
    codes = job.wait(300)
    assert set(codes.values()) == {0}, f"{codes}\n{job.output()}"
    lines = {c: podman.logs(c) for c in job.containers}
    hashes = [h for c in job.containers for h in _done_hashes(lines[c])]
    r = job.results()
    assert len(hashes) == 2 and set(hashes) == {r["weights_sha256"]}, hashes
    assert r["strategy"] == "multiworker" and r["num_workers"] == 2 and r["global_steps"] == 200
    assert r["steps_per_worker"] == {"worker:0": 200, "worker:1": 200}
    assert r["test_accuracy"] >= LOGREG_BAR
    # Written by the image's user, on a volume that user owns.
    run = job.run_dir()
    assert run.parent.stat().st_uid == 1000
    assert {(p.stat().st_uid, p.stat().st_gid) for p in [run, *run.rglob("*")]} == {(1000, 1000)}
    assert {"results.json", "model.keras", "checkpoints"} <= {p.name for p in run.iterdir()}


def test_ps_job_of_four_containers_with_exact_step_accounting(podman, image, network, mnist):
    job = Job(podman, network, "ps", {"chief": 1, "worker": 2, "ps": 1}, "ps",
              [*LOGREG, "--steps", "300", "--steps-per-execution", "5"], mnist)
    job.start()
    codes = job.wait(300)
    assert set(codes.values()) == {0}, f"{codes}\n{job.output()}"
    r = job.results()
    assert r["strategy"] == "ps" and r["num_workers"] == 2 and r["num_ps"] == 1
    # Every scheduled step applied once to the ps-held counter, split between the two workers.
    assert r["global_steps"] == r["scheduled_steps"] == r["completed_steps"] == 300
    assert r["applied_steps"] == 300 and r["reexecuted_steps"] == 0
    workers = r["steps_per_worker"]
    assert set(workers) == {"worker:0", "worker:1"} and sum(workers.values()) == 300
    assert all(n > 0 for n in workers.values()), workers
    assert set(r["variables_per_ps"]) == {"ps:0"} and r["variables_per_ps"]["ps:0"] > 0
    assert r["test_accuracy"] >= LOGREG_BAR
    # ps and workers stop by themselves once the chief is done.
    assert any("chief" in l and "gone" in l for l in podman.logs("ps-ps-0")), job.output()


def test_multiworker_preempted_by_podman_stop_resumes_at_the_agreed_step(podman, image, network, mnist,
                                                                       request):
    steps = 1500
    job = Job(podman, network, "pre", {"worker": 2}, "multiworker", [*LOGREG, "--steps", str(steps)], mnist)
    job.start()
    follow = podman.follow("pre-worker-1")
    try:
        follow.wait_for_line(r"^step 300/", 240)
    finally:
        follow.kill()
    # What a scheduler does: SIGTERM to PID 1 (tini), SIGKILL after 30 s.
    podman("stop", "--time", "30", "pre-worker-1", timeout=60)
    codes = job.wait(120)
    assert codes == {"pre-worker-0": 42, "pre-worker-1": 42}, f"{codes}\n{job.output()}"
    saved = {c: [int(m.group(1)) for l in podman.logs(c)
                 if (m := re.match(r"preempted: checkpoint saved at step (\d+);", l))]
             for c in job.containers}
    assert len(saved["pre-worker-0"]) == 1 and saved["pre-worker-0"] == saved["pre-worker-1"], saved
    agreed = saved["pre-worker-0"][0]
    assert 300 <= agreed < steps
    assert not (job.run_dir() / "results.json").exists()

    # The same containers started again (what a restart policy does): they resume there.
    job.start()
    codes = job.wait(300)
    assert set(codes.values()) == {0}, f"{codes}\n{job.output()}"
    for c in job.containers:
        resumed = [int(m.group(1)) for l in podman.logs(c)
                   if (m := re.match(r"resumed from \S+ at step (\d+) of", l))]
        assert resumed == [agreed], (c, resumed)
    r = job.results()
    assert r["resumed_from_step"] == agreed
    assert r["global_steps"] == steps and r["steps_this_run"] == steps - agreed
    assert r["steps_per_worker"] == {"worker:0": steps - agreed, "worker:1": steps - agreed}
    assert r["test_accuracy"] >= LOGREG_BAR
    assert all("Traceback" not in l for c in job.containers for l in podman.logs(c))
    _report(request, f"preemption: podman stop at step >= 300 of {steps}; every worker saved at "
                     f"step {agreed} and exited 42; restarted, both resumed at step {agreed}")
