"""A P/D fleet's membership, shared by whoever registers an instance (the vLLM connector, ``kvpush.integrations``)
and whoever reads the registry (the router, ``kvrouter``; ``kvpush fleet``): what an instance registers and what a
reader makes of it, without I/O (``membership``), and its store, etcd v3 (``etcd``, the ``fleet`` extra, imported
only by name: ``from kvpush.fleet.etcd import Registrar``). It imports nothing else of kvpush.
"""

from .membership import (
    DEFAULT_ETCD_PORT,
    PREFIX,
    REFRESH_S,
    ROLES,
    STATES,
    TTL_S,
    FleetError,
    Instance,
    Load,
    Membership,
    load_of,
    parse_discovery,
    parse_load,
)

__all__ = ["DEFAULT_ETCD_PORT", "PREFIX", "REFRESH_S", "ROLES", "STATES", "TTL_S", "FleetError", "Instance", "Load",
           "Membership", "load_of", "parse_discovery", "parse_load"]
