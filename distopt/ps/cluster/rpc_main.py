"""``python -m distopt.ps.cluster.rpc_main CONFIG_JSON``: the command of one RPC server process.

:class:`~distopt.ps.cluster.rpc_backend.RpcBackend` spawns it with the JSON that
:func:`distopt.ps.cluster.rpc_process.config` builds; it runs
:func:`~distopt.ps.cluster.rpc_process.serve`. It is a module of its own, which nothing imports,
because ``python -m`` warns (``RuntimeWarning: ... found in sys.modules``) in every server log when
the module it runs was already imported while its packages were (``import distopt`` imports
``rpc_process``).
"""

from __future__ import annotations

import json
import sys

from distopt.errors import ConfigError, RemoteCallError
from distopt.ps.cluster.rpc_process import serve


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            f"usage: python -m {__spec__.name if __spec__ else __name__} CONFIG_JSON",
            file=sys.stderr,
        )
        return 2
    try:
        serve(json.loads(args[0]))
    except (ConfigError, RemoteCallError) as err:
        print(f"distopt.ps.server: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
