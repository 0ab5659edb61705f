"""StrideWeave: tensors whose storage is tiled and tiered.

A C++20 engine (``strideweave._core``) with a thin Python face. Layouts map
logical coordinates to physical slots; carriers hold the slots; tensors are
views of carriers; movement is asynchronous behind one completion contract.
"""

from . import carriers, friendly, layout
from ._core import (
    CPU,
    AwaitMove,
    AwaitResult,
    BlockDevice,
    BlockDeviceCarrier,
    Carrier,
    DependentCarrier,
    DType,
    Evictable,
    FileBacked,
    Generic,
    Layout,
    Shape,
    Stride,
    Tensor,
    add,
    div,
    elementwise_mul,
    exp,
    from_dlpack,
    mapping_cache_bytes,
    matmul,
    move_async,
    mul,
    neg,
    reduce_sum,
    relu,
    set_mapping_cache_decay,
    set_mapping_cache_limit,
    set_turn_wait_limit,
    sub,
    turn_wait_limit,
    # activations
    sigmoid,
    silu,
    # row operations
    index_add,
    index_select,
    softmax,
    topk,
)
from .autograd import is_grad_enabled, no_grad, set_grad_enabled
from .carriers import extension
from .carriers.tiled_evictable import (
    AwaitProjection,
    AwaitResidency,
    ResidencyPlan,
    ResidencyPolicy,
    TiledEvictable,
    TiledResidencyFacet,
    TileSelection,
    TileSet,
)
from .carriers.extension import (
    CarrierDefinition,
    CarrierFacet,
    PreparedTransfer,
    StorageProvider,
    TransferProvider,
    TransferRequest,
    TransferRoute,
    Unsupported,
    register_carrier_definition,
)
from .friendly import column_major, row_major
from . import policies  # noqa: E402  (built-in residency policies)
from . import safetensors  # noqa: E402  (sw.safetensors.open / save)
# views: narrow, chunk, permute, reshape
from ._core import chunk, narrow, permute, reshape, reshape_is_view  # noqa: E402

# one residency budget for weights and their gradients
from .carriers.tiled_evictable import ResidencyBudget  # noqa: E402

# optimizers on tiled parameters
from . import optim  # noqa: E402
# sparse MoE block
from . import moe  # noqa: E402


def move(tensor: Tensor, destination: Carrier) -> Tensor:
    """Exactly ``move_async(tensor, destination).wait()``."""
    return move_async(tensor, destination).wait()


__all__ = [
    "AwaitProjection",
    "AwaitResidency",
    "ResidencyPlan",
    "ResidencyPolicy",
    "TileSelection",
    "TileSet",
    "TiledEvictable",
    "TiledResidencyFacet",
    "add",
    "div",
    "elementwise_mul",
    "exp",
    "from_dlpack",
    "is_grad_enabled",
    "mapping_cache_bytes",
    "matmul",
    "mul",
    "neg",
    "no_grad",
    "reduce_sum",
    "relu",
    "set_grad_enabled",
    "set_mapping_cache_decay",
    "set_mapping_cache_limit",
    "set_turn_wait_limit",
    "turn_wait_limit",
    "sub",
    # activations
    "sigmoid",
    "silu",
    "AwaitMove",
    "AwaitResult",
    "BlockDevice",
    "BlockDeviceCarrier",
    "CPU",
    "Carrier",
    "CarrierDefinition",
    "CarrierFacet",
    "DType",
    "DependentCarrier",
    "Evictable",
    "FileBacked",
    "Generic",
    "Layout",
    "PreparedTransfer",
    "Shape",
    "StorageProvider",
    "Stride",
    "Tensor",
    "TransferProvider",
    "TransferRequest",
    "TransferRoute",
    "Unsupported",
    "carriers",
    "column_major",
    "extension",
    "friendly",
    "layout",
    "move",
    "move_async",
    "policies",
    "register_carrier_definition",
    "row_major",
    "safetensors",
    # one residency budget for weights and their gradients
    "ResidencyBudget",
    # row operations
    "index_add",
    "index_select",
    "softmax",
    "topk",
    # optimizers on tiled parameters
    "optim",
    # sparse MoE block
    "moe",
]
