"""The media repository: upload, download, thumbnails, remote media, URL previews (docs/media.md)."""
