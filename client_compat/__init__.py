"""What SDK and cookbook users need next to the `tinker` SDK to use a self-hosted server well.

`images.ImageChunker` builds image chunks offline with the expected_tokens the server checks;
`chat.ChatRenderer` renders chat messages (with images) with the model's own chat template;
`rollout.Episode` keeps a multi-turn (vision-language) RL episode token in, token out and builds
its training datums; `env.ConversationEnv` runs it in the cookbook's RL loop; `examples/` has a
small multi-turn VLM task trained both ways.
`conformance` checks any Tinker-compatible server against the pinned SDK
(`python -m client_compat.conformance --base-url URL`).
"""
