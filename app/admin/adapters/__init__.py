"""Admin routes for adapters: upload, list, get, delete, load, unload and pin; checked, stored, recorded, registered."""
