"""What SDK and cookbook users need next to the `tinker` SDK to use a self-hosted server well.

`images.ImageChunker` builds image chunks offline with the expected_tokens the server checks. The
design's conformance checker and multi-turn rollout helper are not written yet (see the README).
"""
