"""Shared parts of the fake nvidia-imex and nvidia-imex-ctl (see README.md here).

Python 3 standard library only, so CI compiles nothing for them.
"""

import hashlib
import os
import socket

DEFAULT_CONFIG = "/etc/nvidia-imex/config.cfg"
DEFAULT_NODES = "/etc/nvidia-imex/nodes_config.cfg"


def read_config(path):
    """KEY=VALUE lines, '#' comments, as IMEX's config.cfg."""
    cfg = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#") or "=" not in line:
                continue
            key, _, value = line.partition("=")
            cfg[key.strip()] = value.strip()
    return cfg


def read_nodes(path):
    """One node (IP or DNS name) a line, in order, as IMEX's nodes_config.cfg."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]


def read_hosts(path):
    """name -> IP from an /etc/hosts-format file (missing file: empty)."""
    hosts = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.split("#", 1)[0].split()
                if len(line) >= 2:
                    for name in line[1:]:
                        hosts.setdefault(name, line[0])
    except FileNotFoundError:
        pass
    return hosts


def knob(cfg, key, default=""):
    """A test knob: the config file's key, else the environment's, else the default."""
    return cfg.get(key) or os.environ.get(key) or default


def resolve(name, hosts):
    """An IP literal stays; a name resolves through `hosts` (name -> IP), else None."""
    try:
        socket.inet_aton(name)
        return name
    except OSError:
        pass
    return hosts.get(name)


def nodes_key(nodes):
    """What two daemons compare to agree on one node map (order-insensitive)."""
    return hashlib.sha256("\n".join(sorted(nodes)).encode()).hexdigest()[:16]


def cmd_address(cfg):
    """(family, address) of the command service, or None when it is off."""
    if cfg.get("IMEX_CMD_ENABLED", "0") != "1":
        return None
    path = cfg.get("IMEX_CMD_UNIX_DOMAIN_PATH", "")
    if path:
        return (socket.AF_UNIX, path)
    port = cfg.get("IMEX_CMD_PORT", "")
    if not port:
        return None
    ip = cfg.get("IMEX_CMD_BIND_INTERFACE_IP", "") or "127.0.0.1"
    return (socket.AF_INET, (ip, int(port)))
