"""Shadow samples: more completions of a live call, ranked by a judge, trained as a group.

A production session happens once and its reward may never come. With `--shadow-samples K`
the gateway samples K more completions of a share of the live calls (`--shadow-rate`) in the
background, from the adapter step that answered the call and with its sampling parameters
(the seed removed, or every shadow would be the same), never returned to the client and never
delaying it. The judge (`--shadow-judge-model`, RULER) ranks the live answer and its shadows;
the turn becomes a training group of its own (`origin` 'shadow'), whose context is the
recorded conversation up to that turn and whose sampled turn is all that trains.

`calls` says which calls are shadowed and builds the rows (pure functions); `sampler` runs
the background work: the cap, the wait for a quiet engine, the engine call, the record, the
judgement, the counts.
"""
