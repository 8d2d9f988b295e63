"""Imported last by the ranks' fork server (``launch._mp_context``'s preload list): the model
loading work every rank would otherwise repeat after its fork (``engine.model.warm_loading``)."""

from ..engine.model import warm_loading

warm_loading()
