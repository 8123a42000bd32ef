"""The bottom layer, which every other may import: the error hierarchy and the kit that shows
foreign input in messages (`_errors`), the processes of a run and what they agree on
(`_multihost`), named plugin registries (`_plugins`), and Ctrl-C while the `ucp` command
starts (`_startup`)."""
