"""ZMQ grid transport: one GridSender per model, one GridReceiver per trainer rank."""

from megatron_rl.transport.codec import TransportError, TransportTimeout, decode_grid_item, encode_grid_item
from megatron_rl.transport.zmq_grid import GridReceiver, GridSender

__all__ = [
    "GridReceiver",
    "GridSender",
    "TransportError",
    "TransportTimeout",
    "decode_grid_item",
    "encode_grid_item",
]
