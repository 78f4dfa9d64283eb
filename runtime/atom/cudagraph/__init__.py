"""CUDA graphs for the runtime: recording, replay and the per-step choice between them.

Owns the recordings (`region_graph`: `TokenGraph` per token bucket, breakable at
`@eager_region` ops; `ReqGraph` per request bucket; the shared graph pool) and the
`GraphRunner` (`runner`): graph-mode resolution, capture at warm-up and the per-step
dispatch (`ForwardMode.decide`). It drives a model runner through the `GraphRunnerHost`
protocol and never imports the engine or the entrypoints.
"""
