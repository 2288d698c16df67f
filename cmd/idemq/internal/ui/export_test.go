package ui

// LocalPath is localPath, for the tests of package ui_test.
var LocalPath = localPath
