"""Index math only: layouts as segment lists, routes, plans and their cache.

No torch.distributed and no device work here (device copies of index tensors are made
once per micro-batch, host->device).
"""

from .boundaries import sbhd_cu_seqlens, validate_cu_seqlens
from .chunkwise import ChunkwisePlan, build_chunkwise_plan
from .plan import CPPlan, RouteCache, plan_for_sbhd
from .route import NaturalOrder, Route, build_natural_order, build_sbhd_route, build_thd_route
from .segments import CONTIGUOUS, LAYOUTS, ZIGZAG, Runs, expand_runs

__all__ = [
    "CONTIGUOUS",
    "ZIGZAG",
    "LAYOUTS",
    "Runs",
    "expand_runs",
    "validate_cu_seqlens",
    "sbhd_cu_seqlens",
    "Route",
    "build_thd_route",
    "build_sbhd_route",
    "NaturalOrder",
    "build_natural_order",
    "ChunkwisePlan",
    "build_chunkwise_plan",
    "CPPlan",
    "RouteCache",
    "plan_for_sbhd",
]
