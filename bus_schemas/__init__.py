"""The wire contract between Prorsa actors.

One module per message family (`work`, `lifecycle`, `control`, `status`, `train`), every
subject name built in `subjects`, every JetStream stream defined in `streams`, and the
encode/decode edge in `codec`. Actors never exchange dicts: they exchange these Structs.
"""
