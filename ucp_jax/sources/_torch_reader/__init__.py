"""The safe reader of torch files that several sources share (torch files, DeepSpeed, DCP's
metadata, Hugging Face's `pytorch_model.bin`): zip archives and pickles read without torch
and without running pickled code (`_torch_file`), and the state dicts and optimizer states
they hold (`_state_dict`, `_optimizer`)."""
