"""What a run left in durable storage and what becomes of it, called the same way by the flow's steps (`tasks/`),
the CLI and the sweep:

- `discover`: every artifact under a run root listed and checked (the manifest written);
- `export`: the checked sampler checkpoint as a Hugging Face PEFT adapter, converted (`conversion`), proven
  outside SkyRL-tx (`proof`) and committed (`writer`), with one run card for its model card;
- `prune`: what retention lets go, never what a promotion was made from;
- `promote`: an export published under a name, with one record shape, and who approved it.

The records and storage primitives these use (markers, discovery, leases, promotion pointers, retention rules)
are `txflow.checkpoints`'s."""
