"""Is a Ray cluster answering at the address a run joins? Asked before `ray.init`, which waits for minutes (and
cannot be interrupted) when nothing, or something other than Ray, answers there.

Two questions, each bounded by `PROBE_TIMEOUT_S`: does a TCP connection open (refused, unreachable, a name that
does not resolve or no answer say why not), and does a gRPC call of Ray's own get a gRPC answer (Ray's GCS:
`NodeInfoGcsService/GetClusterId`; the Ray Client server of `ray://`: `RayletDriver/ClusterInfo`). An answer that
is not gRPC (an HTTP server, a proxy with nothing behind it), or a gRPC server without that call, is another
service on that port. A refusal for want of credentials counts as Ray's answer: `ray.init` then says what is
wrong. Light imports only (grpc, which
Ray needs, is imported when asked): `qwen35rl-train` asks before importing torch or Ray.
"""
from __future__ import annotations

import os
import socket
from typing import Optional, Tuple

PROBE_TIMEOUT_S = 5.0
"""How long the connection and the gRPC answer may each take."""
_GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
_CLIENT_METHOD = "/ray.rpc.RayletDriver/ClusterInfo"
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def host_port(address: str) -> Optional[Tuple[str, int]]:
    """(host, port) of `host:port`, `ray://host:port` or `[v6]:port`; None for `auto`, `local` or anything else."""
    text = str(address).strip()
    if text.startswith("ray://"):
        text = text[len("ray://"):]
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def unreachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why no Ray cluster answers at `address` (host:port or ray://host:port), or None when one does (or the
    address is not one this can check)."""
    where = host_port(address)
    if where is None:
        return None
    host, port = where
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except socket.gaierror as e:
        return f"the host name {host!r} does not resolve ({e.strerror or e})"
    except ConnectionRefusedError:
        return f"nothing listens on port {port} of {host} (connection refused)"
    except (socket.timeout, TimeoutError):
        return (f"no answer within {timeout_s:g} s: the host is down or unreachable, or a firewall drops the "
                f"connection")
    except OSError as e:
        return f"cannot connect to {host}:{port} ({e.strerror or e})"
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None  # a TLS cluster: the plain calls below would not be understood
    client = str(address).strip().startswith("ray://")
    target = str(address).strip()[len("ray://"):] if client else str(address).strip()
    try:
        import grpc
    except ImportError:
        return _no_http2(host, port, timeout_s)
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(_CLIENT_METHOD if client else _GCS_METHOD)(b"", timeout=timeout_s)
            return None
        except grpc.RpcError as e:
            code, details = e.code(), " ".join(str(e.details() or "").split())
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return None  # Ray, refusing this call: ray.init says why (a token, say)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"port {port} of {host} accepts connections, but no Ray answer came within {timeout_s:g} s"
    return (f"port {port} of {host} answers, but not as a Ray cluster does ({code.name}: {details[:160]}): another "
            f"service listens there, or a proxy with no cluster behind it")


def _no_http2(host: str, port: int, timeout_s: float) -> Optional[str]:
    """Without grpc: whether the port answers the HTTP/2 connection preface with a SETTINGS frame, as gRPC does."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(_H2_PREFACE)
            head = b""
            while len(head) < 9:
                chunk = conn.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
    except OSError as e:
        return f"port {port} of {host} accepts connections, but does not answer as a Ray cluster does ({e})"
    if len(head) < 9 or head[3] != 0x04:
        return f"port {port} of {host} answers, but not as a Ray cluster does (no gRPC): another service listens there"
    return None


def ray_address_problem(address: str, source: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """The error text when no Ray cluster answers at `address` (set by `source`: `ray_address` or `RAY_ADDRESS`),
    naming it and the fix; None when one answers."""
    why = unreachable(address, timeout_s)
    if why is None:
        return None
    where = host_port(address)
    port = where[1] if where else 6379
    if str(address).strip().startswith("ray://"):
        start, what = f"ray start --head --ray-client-server-port={port}", "its Ray Client port, 10001 unless set"
    else:
        start, what = f"ray start --head --port={port}", "its GCS port, 6379 unless set"
    return (f"[ray_unreachable] {source}={address}: no Ray cluster answers there: {why}; nothing was started\n"
            f"  fix:   start Ray on that node first (`{start}`, or launch/slurm_ray.sh on Slurm), or correct {source} "
            f"(the head node's address and {what}); with neither ray_address nor RAY_ADDRESS set, the run starts a "
            f"local cluster on this machine" + (" (ray_address, when set, takes precedence over RAY_ADDRESS)"
                                                if source == "RAY_ADDRESS" else ""))
