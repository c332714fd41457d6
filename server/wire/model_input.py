"""What a model reads off the wire: the chunk list shared by sampling (JSON) and training (protobuf),
and tensors in JSON (dense or 2-D sparse CSR)."""

from __future__ import annotations

import base64
import binascii
import math
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import Field, field_serializer, field_validator, model_validator

from server.wire.base import Int32, WireRequest


class EncodedTextChunk(WireRequest):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[Int32]


class ImageChunk(WireRequest):
    """An image file (png or jpeg). JSON carries it as standard base64, protobuf as raw bytes."""

    type: Literal["image"] = "image"
    data: bytes
    format: Literal["png", "jpeg"]
    expected_tokens: Int32 | None = None
    """Advisory token count from the client; the server computes the true one."""

    @field_validator("data", mode="before")
    @classmethod
    def _decode_base64(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as error:
            raise ValueError(f"image data is not valid standard base64 ({error})") from None

    @field_serializer("data", when_used="json")
    def _encode_base64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")


class ImageAssetPointerChunk(WireRequest):
    """An image named by path or URL instead of inlined (sampling requests only)."""

    type: Literal["image_asset_pointer"] = "image_asset_pointer"
    format: Literal["png", "jpeg"]
    location: Annotated[str, Field(min_length=1, max_length=4096)]
    expected_tokens: Int32 | None = None


Chunk = Annotated[
    Union[EncodedTextChunk, ImageChunk, ImageAssetPointerChunk], Field(discriminator="type")
]


DMEL_NOT_SUPPORTED = "audio (dmel) chunks are not supported"


class ModelInput(WireRequest):
    chunks: list[Chunk]

    @field_validator("chunks", mode="before")
    @classmethod
    def _reject_dmel(cls, chunks: Any) -> Any:
        # Checked before the union so the user gets a sentence, not "tag 'dmel' does not match".
        if isinstance(chunks, list):
            for chunk in chunks:
                if isinstance(chunk, dict) and chunk.get("type") == "dmel":
                    raise ValueError(DMEL_NOT_SUPPORTED)
        return chunks


# ---------------------------------------------------------------------------------------------
# Tensors in JSON (SampleRequest.target_prompt_logprobs).


# A CSR tensor is tiny on the wire but can name a huge dense shape; refuse to densify past this.
MAX_DENSE_ELEMENTS = 1 << 28


def densify_csr(
    values: np.ndarray,
    crow_indices: np.ndarray,
    col_indices: np.ndarray,
    shape: list[int],
    pad_value: float = 0,
) -> np.ndarray:
    """Expand a 2-D CSR tensor to dense, with `pad_value` in every unlisted cell."""
    check_csr(len(values), crow_indices, col_indices, shape)
    num_rows, num_cols = shape
    if num_rows * num_cols > MAX_DENSE_ELEMENTS:
        raise ValueError(f"sparse tensor of shape {shape} is too large to densify")
    dense = np.full((num_rows, num_cols), pad_value, dtype=values.dtype)
    dense[np.repeat(np.arange(num_rows), np.diff(crow_indices)), col_indices] = values
    return dense


def check_csr(num_values: int, crow_indices: np.ndarray, col_indices: np.ndarray, shape: list[int]) -> None:
    """Raise ValueError unless the arrays are a valid 2-D CSR layout of `shape` (nothing is allocated)."""
    if len(shape) != 2:
        raise ValueError(f"a sparse CSR tensor needs a 2-D shape, got {shape}")
    num_rows, num_cols = shape
    if num_rows < 0 or num_cols < 0:
        raise ValueError(f"shape {shape} has a negative dimension")
    if len(crow_indices) != num_rows + 1:
        raise ValueError(
            f"sparse CSR crow_indices has {len(crow_indices)} entries, expected rows+1 = {num_rows + 1}"
        )
    if len(col_indices) != num_values:
        raise ValueError(
            f"sparse CSR has {num_values} values but {len(col_indices)} col_indices"
        )
    row_counts = np.diff(crow_indices)
    if crow_indices[0] != 0 or crow_indices[-1] != num_values or np.any(row_counts < 0):
        raise ValueError(
            "sparse CSR crow_indices must start at 0, never decrease, and end at the number of values"
        )
    if len(col_indices) and (col_indices.min() < 0 or col_indices.max() >= num_cols):
        raise ValueError(f"sparse CSR col_indices must lie in [0, {num_cols})")


class TensorData(WireRequest):
    """A tensor as JSON: flat `data`, dense or 2-D sparse CSR."""

    data: list[int] | list[float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @model_validator(mode="after")
    def _check_layout(self) -> TensorData:
        if (self.sparse_crow_indices is None) != (self.sparse_col_indices is None):
            raise ValueError("sparse_crow_indices and sparse_col_indices come together")
        if self.sparse_crow_indices is None and self.shape is not None:
            if min(self.shape, default=0) < 0 or math.prod(self.shape) != len(self.data):
                raise ValueError(f"shape {self.shape} does not hold {len(self.data)} values")
        if self.sparse_crow_indices is not None:
            if self.shape is None:
                raise ValueError("a sparse CSR tensor needs its dense shape")
            check_csr(len(self.data), np.asarray(self.sparse_crow_indices, dtype=np.int64),
                      np.asarray(self.sparse_col_indices, dtype=np.int64), self.shape)
        return self

    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, value) of each cell the tensor lists, in the order of `data`: every cell of a dense
        2-D tensor, only the listed ones of a CSR tensor (which never densifies)."""
        values = np.asarray(self.data, dtype=np.int64 if self.dtype == "int64" else np.float32)
        if self.sparse_crow_indices is None:
            num_rows, num_cols = self.shape
            return np.repeat(np.arange(num_rows), num_cols), values
        return np.repeat(np.arange(self.shape[0]), np.diff(self.sparse_crow_indices)), values
