"""Coordinator <-> rank authentication: the group token on every call, and TLS with a CA made here.

The rank is the real gRPC server over the page-bookkeeping engine of test_rank_service; the coordinator's
side is the real `RankLink` (asyncio) or a blocking channel built by the same `RankClientAuth`.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import signal
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lockstep.coordinator.config import parse_config
from lockstep.coordinator.rank_link import RankLink
from lockstep.proto_gen.lockstep.v1 import rank_pb2 as pb
from lockstep.proto_gen.lockstep.v1 import rank_pb2_grpc
from lockstep.rank.main import parse_args
from lockstep.rank.service import RankServer, RankServicer
from lockstep.rank_auth import (
    TOKEN_METADATA_KEY,
    RankClientAuth,
    RankServerAuth,
    env_with_token,
    read_token,
    server_auth,
)
from lockstep.steps import Admit, Chunk, Plan
from test_rank_service import PoolEngine, StepStream, _free_port, _start_rank, _wait_for_health, pool

TOKEN = "s3cret-group-token-0123456789"


class TokenStream(StepStream):
    """A Step stream that sends `metadata` (the token, a wrong one, or none)."""

    def __init__(self, channel: grpc.Channel, metadata: tuple = ()) -> None:
        import queue

        self._outbox = queue.SimpleQueue()
        self._reports = rank_pb2_grpc.RankServiceStub(channel).Step(iter(self._outbox.get, None), timeout=20,
                                                                     metadata=metadata)


def serve(auth: RankServerAuth) -> tuple[PoolEngine, RankServer, str]:
    engine = PoolEngine()
    server = RankServer(RankServicer(0, engine), "127.0.0.1:0", auth=auth)
    server.start()
    server.set_serving(True)
    return engine, server, f"127.0.0.1:{server.port}"


@pytest.fixture
def guarded():
    """A rank that asks for TOKEN: (engine, servicer, address)."""
    engine, server, address = serve(RankServerAuth(token=TOKEN))
    yield engine, server.servicer, address
    server.stop(grace=0.2)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_a_stream_without_the_token_never_supersedes_the_coordinators(guarded):
    engine, servicer, address = guarded
    with grpc.insecure_channel(address) as ours, grpc.insecure_channel(address) as theirs:
        coordinator = TokenStream(ours, ((TOKEN_METADATA_KEY, TOKEN),))
        r0 = coordinator.step(Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", (1, 2, 3), 0),)))
        assert pool(r0).used == 1
        for metadata in ((), ((TOKEN_METADATA_KEY, "wrong"),), ((TOKEN_METADATA_KEY, TOKEN[:-1]),),
                         (("authorization", f"Bearer {TOKEN}"),)):
            intruder = TokenStream(theirs, metadata)
            assert _code(lambda s=intruder: s.step(Plan(step=1, releases=("a",)))) == grpc.StatusCode.UNAUTHENTICATED
        stub = rank_pb2_grpc.RankServiceStub(theirs)
        assert _code(lambda: stub.Info(pb.InfoRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        # The coordinator's stream is still the rank's, and nothing the intruders sent ran.
        r1 = coordinator.step(Plan(step=1, batch=(Chunk("a", (4,), 3),)))
        assert pool(r1).used == 1 and engine.executed == [0, 1] and servicer.last_step == 1
        info = stub.Info(pb.InfoRequest(), timeout=5, metadata=((TOKEN_METADATA_KEY, TOKEN),))
        assert info.last_step == 1
        coordinator.close()


def test_health_stays_open_for_probes(guarded):
    _, _, address = guarded
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_rank_link_sends_the_token_on_every_call(guarded):
    engine, _, address = guarded

    async def scenario() -> None:
        link = RankLink(0, address, RankClientAuth(token=TOKEN))
        stranger = RankLink(0, address, RankClientAuth(token="not-the-token"))
        try:
            assert (await link.info()).rank == 0 and await link.responsive()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stranger.info()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "group token" in e.value.details()
            inbox: asyncio.Queue = asyncio.Queue()
            await link.open(inbox)
            link.send(Plan(step=0, admits=(Admit("a"),), batch=(Chunk("a", (1, 2), 0),)))
            rank, report = await asyncio.wait_for(inbox.get(), 10)
            assert rank == 0 and pool(report).used == 1
            stray: asyncio.Queue = asyncio.Queue()
            await stranger.open(stray)  # refused: the reason lands in its inbox, and `link` keeps the rank
            rank, reason = await asyncio.wait_for(stray.get(), 10)
            assert isinstance(reason, str) and "UNAUTHENTICATED" in reason
            link.send(Plan(step=1, releases=("a",)))
            _, report = await asyncio.wait_for(inbox.get(), 10)
            assert report.step == 1 and not report.error and engine.executed == [0, 1]
        finally:
            await link.close()
            await stranger.close()

    asyncio.run(scenario())


def test_a_rank_without_a_token_serves_anyone_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="lockstep.rank.service"):
        _, server, address = serve(RankServerAuth())
    try:
        assert "anyone who reaches port" in caplog.text
        with grpc.insecure_channel(address) as channel:
            assert rank_pb2_grpc.RankServiceStub(channel).Info(pb.InfoRequest(), timeout=5).rank == 0
    finally:
        server.stop(grace=0)


def test_token_sources(tmp_path: Path):
    file = tmp_path / "token"
    file.write_text(TOKEN + "\n")
    assert read_token(str(file), {"LOCKSTEP_GROUP_TOKEN": "from-env"}) == TOKEN  # the file wins
    assert read_token(None, {"LOCKSTEP_GROUP_TOKEN": " from-env "}) == "from-env"
    assert read_token(None, {"LOCKSTEP_GROUP_TOKEN": ""}) is None and read_token(None, {}) is None
    (tmp_path / "empty").write_text("\n")
    for path, words in ((tmp_path / "empty", "must be printable ASCII"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(ValueError, match=words):
            read_token(str(path), {})
    with pytest.raises(ValueError, match="LOCKSTEP_GROUP_TOKEN: the group token must be printable ASCII"):
        read_token(None, {"LOCKSTEP_GROUP_TOKEN": "two words"})
    env = env_with_token(TOKEN, {"LOCKSTEP_GROUP_TOKEN_FILE": "/x", "PATH": "/bin"})
    assert env == {"LOCKSTEP_GROUP_TOKEN": TOKEN, "PATH": "/bin"}


def test_rank_and_coordinator_read_the_token_and_tls_settings(tmp_path: Path, pki: dict[str, Path]):
    file = tmp_path / "token"
    file.write_text(TOKEN)
    cfg = parse_args(["--group-token-file", str(file)], env={}, hostname="laptop")
    assert cfg.auth.token == TOKEN and cfg.auth.credentials() is None and TOKEN not in repr(cfg)
    cfg = parse_args([], env={"LOCKSTEP_GROUP_TOKEN": TOKEN, "LOCKSTEP_TLS_CERT": str(pki["server.pem"]),
                              "LOCKSTEP_TLS_KEY": str(pki["server.key"])}, hostname="laptop")
    assert cfg.auth.tls_cert == pki["server.pem"].read_bytes() and cfg.auth.tls_client_ca is None
    conf = parse_config(["--group", "g0=a:1", "--rank-tls-ca", str(pki["ca.pem"])],
                        env={"LOCKSTEP_GROUP_TOKEN_FILE": str(file)})
    assert conf.rank_auth.token == TOKEN and conf.rank_auth.tls and TOKEN not in repr(conf)
    assert parse_config(["--group", "g0=a:1"], env={}).rank_auth == RankClientAuth()


@pytest.mark.parametrize("argv, words", [
    (["--tls-cert", "x.pem"], "--tls-cert and --tls-key"),
    (["--tls-ca", "ca.pem"], "--tls-ca (LOCKSTEP_TLS_CA) asks for client certificates"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "--tls-cert: cannot read"),
    (["--group-token-file", "/nonexistent"], "cannot read the group token file /nonexistent"),
])
def test_rank_refuses_bad_security_settings_by_name(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv, env={}, hostname="laptop")
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--rank-tls-key", "k"], "--rank-tls-cert and --rank-tls-key"),
    (["--rank-tls-server-name", "rank"], "needs --rank-tls-ca"),
    (["--rank-tls-ca", "/nonexistent.pem"], "--rank-tls-ca: cannot read"),
])
def test_coordinator_refuses_bad_security_settings_by_name(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--group", "g0=a:1", *argv], env={})
    assert words in capsys.readouterr().err


# ----- TLS, with a CA made for this test run


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
          ca: bool = False, sans: list[x509.GeneralName] | None = None, client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a rank certificate for 127.0.0.1/localhost, one for the name `lockstep-rank` only, a client
    certificate, and a second CA that signed none of them: PEM files by name."""
    out = tmp_path_factory.mktemp("pki")
    files: dict[str, Path] = {}

    def write(name: str, data: bytes) -> None:
        files[name] = out / name
        files[name].write_bytes(data)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    for ca_name in ("ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cn = f"lockstep test {ca_name}"
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_cn)])
        write(f"{ca_name}.pem", _cert(ca_cn, ca_key, subject, ca_key, ca=True).public_bytes(serialization.Encoding.PEM))
        if ca_name == "other-ca":
            break
        for name, sans, client in (
            ("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")], False),
            ("named", [x509.DNSName("lockstep-rank")], False),
            ("client", [x509.DNSName("lockstep-coordinator")], True),
        ):
            key = ec.generate_private_key(ec.SECP256R1())
            write(f"{name}.key", pem_key(key))
            write(f"{name}.pem", _cert(name, key, subject, ca_key, sans=sans, client=client)
                  .public_bytes(serialization.Encoding.PEM))
    return files


def _tls_server(pki: dict[str, Path], cert: str = "server", client_ca: bool = False) -> RankServerAuth:
    return server_auth({"tls_cert": str(pki[f"{cert}.pem"]), "tls_key": str(pki[f"{cert}.key"]),
                        "tls_ca": str(pki["ca.pem"]) if client_ca else None}, {"LOCKSTEP_GROUP_TOKEN": TOKEN})


def _info(auth: RankClientAuth, address: str) -> grpc.StatusCode | int:
    """The rank's Info over a channel made by `auth`: its rank, or the status code of the failure."""
    with auth.channel(address) as channel:
        try:
            return rank_pb2_grpc.RankServiceStub(channel).Info(pb.InfoRequest(), timeout=5,
                                                               metadata=auth.metadata()).rank
        except grpc.RpcError as exc:
            return exc.code()


def test_tls_rank_is_reached_only_by_a_coordinator_that_verifies_it(pki):
    _, server, address = serve(_tls_server(pki))
    ca = pki["ca.pem"].read_bytes()
    try:
        assert _info(RankClientAuth(token=TOKEN, tls_ca=ca, tls=True), address) == 0
        assert _info(RankClientAuth(token=TOKEN), address) == grpc.StatusCode.UNAVAILABLE  # plaintext
        other = pki["other-ca.pem"].read_bytes()
        assert _info(RankClientAuth(token=TOKEN, tls_ca=other, tls=True), address) == grpc.StatusCode.UNAVAILABLE
        assert _info(RankClientAuth(tls_ca=ca, tls=True), address) == grpc.StatusCode.UNAUTHENTICATED

        async def link_over_tls() -> int:
            link = RankLink(0, address, RankClientAuth(token=TOKEN, tls_ca=ca, tls=True))
            try:
                return (await link.info()).rank
            finally:
                await link.close()

        assert asyncio.run(link_over_tls()) == 0
    finally:
        server.stop(grace=0)


def test_tls_server_name_override_and_mutual_tls(pki):
    ca = pki["ca.pem"].read_bytes()
    _, server, address = serve(_tls_server(pki, cert="named"))
    try:  # a certificate for `lockstep-rank` only, reached at 127.0.0.1
        assert _info(RankClientAuth(token=TOKEN, tls_ca=ca, tls=True), address) == grpc.StatusCode.UNAVAILABLE
        named = RankClientAuth(token=TOKEN, tls_ca=ca, tls_server_name="lockstep-rank", tls=True)
        assert _info(named, address) == 0
    finally:
        server.stop(grace=0)
    _, server, address = serve(_tls_server(pki, client_ca=True))
    try:
        assert _info(RankClientAuth(token=TOKEN, tls_ca=ca, tls=True), address) == grpc.StatusCode.UNAVAILABLE
        client = RankClientAuth(token=TOKEN, tls_ca=ca, tls_cert=pki["client.pem"].read_bytes(),
                                tls_key=pki["client.key"].read_bytes(), tls=True)
        assert _info(client, address) == 0
    finally:
        server.stop(grace=0)


def test_rank_process_reads_its_token_from_a_file(tmp_path: Path):
    """`lockstep rank` itself: the token file of its environment is asked of every caller but the probes."""
    file = tmp_path / "token"
    file.write_text(TOKEN + "\n")
    port = _free_port()
    proc = _start_rank(port, load_seconds=0.2, extra_env={"LOCKSTEP_GROUP_TOKEN_FILE": str(file)})
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        _wait_for_health(channel, health_pb2.HealthCheckResponse.SERVING, time.monotonic() + 60)
        stub = rank_pb2_grpc.RankServiceStub(channel)
        assert _code(lambda: stub.Info(pb.InfoRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Info(pb.InfoRequest(), timeout=5, metadata=((TOKEN_METADATA_KEY, TOKEN),)).rank == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        log = proc.stderr.read()
        assert "group token required" in log and "refused 1 call(s) without the right group token" in log
        assert TOKEN not in log
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tls_rank_process_answers_probes_in_plaintext_on_its_health_port_only(tmp_path: Path, pki):
    """`lockstep rank --health-port` with TLS on: the kubelet's plaintext gRPC probe gets grpc.health.v1 there,
    and nothing else; RankService is served only over TLS, with the token, on the main port."""
    file = tmp_path / "token"
    file.write_text(TOKEN)
    port, health_port = _free_port(), _free_port()
    proc = _start_rank(port, load_seconds=0.2, extra_env={
        "LOCKSTEP_GROUP_TOKEN_FILE": str(file), "LOCKSTEP_HEALTH_PORT": str(health_port),
        "LOCKSTEP_TLS_CERT": str(pki["server.pem"]), "LOCKSTEP_TLS_KEY": str(pki["server.key"])})
    probe = grpc.insecure_channel(f"127.0.0.1:{health_port}")
    tls = RankClientAuth(token=TOKEN, tls_ca=pki["ca.pem"].read_bytes(), tls=True)
    try:
        seen = _wait_for_health(probe, health_pb2.HealthCheckResponse.SERVING, time.monotonic() + 60)
        assert seen[-1] == health_pb2.HealthCheckResponse.SERVING, seen
        stub = rank_pb2_grpc.RankServiceStub(probe)
        assert _code(lambda: stub.Info(pb.InfoRequest(), timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
        with_token = ((TOKEN_METADATA_KEY, TOKEN),)
        assert _code(lambda: stub.Info(pb.InfoRequest(), timeout=5, metadata=with_token)) == \
            grpc.StatusCode.UNIMPLEMENTED
        steps = stub.Step(iter([]), timeout=5, metadata=with_token)
        assert _code(lambda: next(steps)) == grpc.StatusCode.UNIMPLEMENTED
        assert _info(tls, f"127.0.0.1:{port}") == 1  # RankService: over TLS, on the main port
        assert _info(RankClientAuth(token=TOKEN), f"127.0.0.1:{port}") == grpc.StatusCode.UNAVAILABLE
        with tls.channel(f"127.0.0.1:{port}") as channel:  # the coordinator's health check still works there
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert f"plaintext health checks on port {health_port}" in proc.stderr.read()
    finally:
        probe.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_health_port_must_differ_from_the_grpc_port(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--port", "50051", "--health-port", "50051"], env={}, hostname="r-0")
    assert "--health-port (LOCKSTEP_HEALTH_PORT) must differ from --port" in capsys.readouterr().err
    assert parse_args(["--health-port", "50052"], env={}, hostname="r-0").health_port == 50052
    assert parse_args([], env={"LOCKSTEP_HEALTH_PORT": "9"}, hostname="r-0").health_port == 9
    assert parse_args([], env={}, hostname="r-0").health_port is None


def test_why_a_group_waits_says_whether_the_coordinator_has_a_token_at_all(guarded):
    """Found by a helper: a coordinator with no token was told the rank "refuses this coordinator's group token"."""
    from lockstep.coordinator.group_ranks import GroupRanks
    from lockstep.coordinator.metrics import Metrics

    _, _, address = guarded

    async def why(auth: RankClientAuth) -> str:
        ranks = GroupRanks("g0", [address], Metrics(), 5.0, 10.0, auth)
        try:
            return (await ranks._infos())[1]
        finally:
            await ranks.close()

    assert "needs a group token and this coordinator has none" in asyncio.run(why(RankClientAuth()))
    assert "refuses this coordinator's group token" in asyncio.run(why(RankClientAuth(token="not-the-token")))


def test_a_refused_group_token_is_logged_as_an_error_since_no_wait_fixes_it(guarded, caplog):
    """Found by a helper: it was logged at INFO, as a rank still loading is."""
    from lockstep.coordinator.group_ranks import GroupRanks
    from lockstep.coordinator.metrics import Metrics

    _, _, address = guarded
    heard: list[str] = []

    async def connect() -> None:
        ranks = GroupRanks("g0", [address], Metrics(), 5.0, 10.0, RankClientAuth(token="not-the-token"))
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ranks.connect(heard.append), 2.0)
        finally:
            await ranks.close()

    with caplog.at_level(logging.INFO, logger="lockstep.group"):
        asyncio.run(connect())
    assert heard and "refuses this coordinator's group token" in heard[0]
    waits = [r for r in caplog.records if "waiting for its ranks" in r.getMessage()]
    assert waits and all(r.levelno == logging.ERROR for r in waits)
