"""TorchX's ``ray`` scheduler where TorchX has none: distopt's (``distopt.torchx.ray_scheduler``).

TorchX's plugin registry imports this module (it scans the ``torchx_plugins.schedulers`` namespace
package) and collects the functions decorated with ``@register.scheduler``. Nothing is registered
where TorchX still ships ``torchx.schedulers.ray_scheduler``: its own ``ray`` stays.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

from torchx.plugins import register

if find_spec("torchx.schedulers.ray_scheduler") is None:

    @register.scheduler(name="ray")
    def ray(session_name: str, **kwargs: Any) -> Any:
        """distopt's Ray scheduler under TorchX's name ``ray``."""
        # Imported when the scheduler is used, not when TorchX lists its schedulers.
        from distopt.torchx.ray_scheduler import create_ray_scheduler

        return create_ray_scheduler(session_name, **kwargs)
