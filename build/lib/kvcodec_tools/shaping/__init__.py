"""Throttled links: a KV store server behind a link of a given rate and one-way delay.

``open_link(rate_mbit, delay_ms, mode)`` returns a ``Link`` (a context manager): ``server_host``
(where a store server binds), ``wrap(argv)`` (runs ``argv`` on the server side), ``expose(port)``
(the ``(host, port)`` a client here connects to), ``down()``, ``describe()``. Two kinds:

- ``netns`` (root only): a network namespace and a veth pair, shaped with ``tc tbf`` (and
  ``netem`` for the delay, or a delay-only relay where the kernel has no netem);
- ``userspace``: a shaping TCP proxy, a child process, on 127.0.0.1.

``mode="auto"`` takes netns when this process may make namespaces, else userspace.

The modules, one job each:

- ``bucket``   the shaping maths: ``TokenBucket``, ``proxy_params``, ``tbf_params``;
- ``proxy``    the userspace proxy (the child ``python -m kvcodec_tools.shaping proxy``, and its launcher);
- ``base``     the ``Link`` contract, its proxies and its state file;
- ``netns``    namespaces, veth pairs and tc: ``NetnsLink``, ``netns_permitted``, ``netem_available``;
- ``link``     ``open_link``, ``UserspaceLink``, ``down_named``, ``down_stale``;
- ``measure``  ``byte_source``, ``measure``, ``check``: the achieved rate and RTT of a link;
- ``cli``      ``perf/link`` (``main``): ``up``, ``down``, ``run -- CMD``, ``check``; ``link_env``;
- ``errors``   ``LinkError``.

Every process here (proxies, the byte source, servers left in a namespace) is stopped by PID
(``kvcodec_tools.procs``), never by name.
"""
from .base import Link
from .bucket import TokenBucket, proxy_params, tbf_params
from .cli import link_env, main
from .errors import LinkError
from .link import UserspaceLink, down_named, down_stale, open_link
from .measure import byte_source, check, measure
from .netns import NetnsLink, netem_available, netns_permitted

__all__ = ["Link", "LinkError", "NetnsLink", "TokenBucket", "UserspaceLink", "byte_source", "check", "down_named",
           "down_stale", "link_env", "main", "measure", "netem_available", "netns_permitted", "open_link",
           "proxy_params", "tbf_params"]
