"""What SDK and cookbook users need next to the `tinker` SDK to use a self-hosted server well.

`images.ImageChunker` builds image chunks offline with the expected_tokens the server checks;
`conformance` checks any Tinker-compatible server against the pinned SDK
(`python -m client_compat.conformance --base-url URL`). The design's multi-turn rollout helper is not
written yet (see the README).
"""
