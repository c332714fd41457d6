"""Tinker's wire: pydantic types (JSON), the protobuf codec, and the content types of stored results."""

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
