"""Secure aggregation without Ray: Bonawitz et al. 2017 ("Practical Secure Aggregation for
Privacy-Preserving Machine Learning", semi-honest variant) and SecAgg+ (Bell et al. 2020,
"Secure Single-Server Aggregation with (Poly)Logarithmic Overhead").

Modules: :mod:`.encoding` (floats <-> Z_2^bits), :mod:`.shamir`, :mod:`.keys` (X25519, HKDF,
ChaCha20-Poly1305, ChaCha20 PRG), :mod:`.graph` (neighbours, thresholds, connectivity),
:mod:`.parameters` (SecAgg+ degree and threshold from a dropout fraction), :mod:`.client` /
:mod:`.server` (state machines), :mod:`.protocol` (:func:`secure_sum`), :mod:`.errors`.
"""
from dpfl_ray.secagg.client import SecAggClient
from dpfl_ray.secagg.config import PHASES, SecAggRoundConfig, wire_size
from dpfl_ray.secagg.encoding import (
    ClipEvent, EncodedVector, FixedPointEncoder, decode, encode, max_abs_value, rounding_error_bound,
)
from dpfl_ray.secagg.errors import (
    EncodingError, EncodingOverflow, SecAggAbort, SecAggError, SecAggProtocolError, ShamirError,
    ShareAuthenticationError, UnmaskRefused,
)
from dpfl_ray.secagg.graph import (
    DEFAULT_DEGREE_FACTOR, NeighbourGraph, build_graph, default_threshold, majority_threshold, secagg_plus_degree,
)
from dpfl_ray.secagg.parameters import SecAggPlusParameters, secagg_plus_parameters
from dpfl_ray.secagg.protocol import SecAggResult, presum_masked, secure_sum
from dpfl_ray.secagg.server import SecAggServer

__all__ = [
    "PHASES", "DEFAULT_DEGREE_FACTOR",
    "SecAggClient", "SecAggServer", "SecAggRoundConfig", "SecAggResult", "NeighbourGraph",
    "secure_sum", "presum_masked", "wire_size", "build_graph", "default_threshold", "majority_threshold",
    "secagg_plus_degree", "secagg_plus_parameters", "SecAggPlusParameters",
    "encode", "decode", "max_abs_value", "rounding_error_bound", "FixedPointEncoder", "EncodedVector", "ClipEvent",
    "SecAggError", "SecAggAbort", "SecAggProtocolError", "ShareAuthenticationError", "UnmaskRefused",
    "ShamirError", "EncodingError", "EncodingOverflow",
]
