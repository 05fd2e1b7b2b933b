"""`kvmesh bench`: a serving benchmark for any OpenAI-compatible endpoint.

Numbers use the definitions of `vllm bench serve` (see README.md in this folder) so that a run
against kvmesh compares directly with a run of vLLM's or SGLang's benchmark against another server.
"""
