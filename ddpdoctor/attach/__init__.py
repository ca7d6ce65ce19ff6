"""`ddpdoctor run`'s room: the Doctor attached to a training script nobody edited.

Nothing here measures or judges: the callback (callback/) does. This room only finds, in a running
script, what a user would have handed `Doctor(...)` (the DDP model when it is built, the optimizer
holding its parameters, the DataLoader it iterates) and where a step begins and ends (the model's first
training forward, the optimizer's step), through torch's own hooks and a wrapper on the constructors;
a framework's Trainer gets the adapter it has. `_site/sitecustomize.py` carries the same
into every Python process a launcher starts (torchrun's workers, mp.spawn's children).
"""
