"""A real Kubernetes control plane as local processes, for tests (envtest-style).

etcd and kube-apiserver (and optionally kube-controller-manager, for garbage
collection, namespace deletion, ServiceAccounts and Deployment/Job controllers) run as
child processes on free loopback ports, with a temporary directory holding certificates
generated with the ``openssl`` CLI, etcd's data, the logs and an admin kubeconfig.

The binaries are built by ``tools/k8s/build.sh`` into a cache outside the repository;
:func:`bin_dir` finds them (``PHASEWISE_K8S_BIN`` overrides). Nothing here needs Docker,
a kubelet or a network beyond loopback.

    with ControlPlane(bin_dir(), controller_manager=True) as cp:
        cp.kubeconfig          # path of an admin kubeconfig (client certificate)
        cp.api_client()        # a kubernetes.client.ApiClient for it
        cp.kubectl("get", "ns")

See docs/k8s-testing.md for the measured start-up time and what each flag is for.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools" / "k8s"

#: Binaries the control plane needs; the others are optional.
REQUIRED_BINARIES = ("etcd", "kube-apiserver")
OPTIONAL_BINARIES = ("kube-controller-manager", "kubectl", "helm")

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


def gie_version() -> str:
    """The Gateway API Inference Extension version whose CRDs the tests install (tools/k8s/gie/go.mod)."""
    return _required_version(TOOLS / "gie" / "go.mod", "sigs.k8s.io/gateway-api-inference-extension")


def inferencepool_crd(directory: Path | None = None) -> Path:
    """Where build.sh copies GIE's InferencePool CRD (``build.sh --crds`` alone does just that)."""
    d = directory or bin_dir()
    return d / "crds" / f"gie-v{gie_version()}" / "inference.networking.k8s.io_inferencepools.yaml"


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
            ("kube-controller-manager",) if self.controller_manager else ()))
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
