"""What SDK and cookbook users need next to the `tinker` SDK to use a self-hosted server well.

Empty for now: the conformance checker and the image-chunk and multi-turn rollout helpers of
the design (section 7) land here with the vision pipeline.
"""
